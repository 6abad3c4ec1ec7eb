"""Property-based fuzzing (hypothesis) of the parsers that read untrusted bytes: the sidecar protocol
decoder, the ring reader and loader, the alerting config loader. Bounded for `make test` (a fixed
seed, a few thousand inputs, well under a minute); bench/fuzz_parsers.py runs the same properties
longer with fresh randomness. Every crash found is kept as a regression test in
tests/fuzz/test_fuzz_regressions.py."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).parent))

import fuzz_targets as targets

SCALE = float(os.environ.get("RANKWATCH_FUZZ_SCALE", "1"))


def bounded(examples: int) -> settings:
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        deadline=None,
        derandomize=True,  # the same inputs every run: a failure in CI is a failure here
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@bounded(1500)
@given(targets.protocol_bodies())
def test_the_protocol_decoder_refuses_what_it_cannot_take_and_nothing_else(body):
    targets.decode_protocol(*body)


RING_DIRECTORY = Path(tempfile.mkdtemp(prefix="rankwatch-fuzz-rings-"))


@bounded(500)
@given(targets.ring_files())
def test_a_damaged_ring_is_read_or_refused_with_a_ring_error(data):
    targets.read_ring_file(data, RING_DIRECTORY)


@bounded(800)
@given(targets.config_texts())
def test_a_damaged_alerting_config_loads_or_names_its_problem(text):
    targets.load_alerting_config(text)


def test_the_undamaged_inputs_are_accepted():
    """The strategies start from valid inputs: were they invalid, the properties would prove little."""
    targets.check_valid_config_loads()
    targets.decode_protocol(targets.protocol.encode(targets.valid_summary()), "gzip")
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "valid.ring"
        path.write_bytes(targets.VALID_RING)
        assert len(targets.load_rings([path]).calls) == 5
