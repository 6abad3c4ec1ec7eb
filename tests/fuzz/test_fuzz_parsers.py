"""Property-based fuzzing (hypothesis) of the parsers that read untrusted bytes: the sidecar protocol
decoder, the ring reader and loader, the Megatrace reader (its C tokeniser when built), the
flight-recorder reader (its restricted unpickler included), the MegaScan reader, the alerting config
loader. Bounded for `make test` (a fixed seed, a few thousand inputs, well under a minute);
bench/fuzz_parsers.py runs the same properties longer with fresh randomness. Every crash found is
kept as a regression test in tests/fuzz/test_fuzz_regressions.py."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import fuzz_targets as targets
from hypothesis import HealthCheck, given, settings

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


MEGATRACE_DIRECTORY = Path(tempfile.mkdtemp(prefix="rankwatch-fuzz-megatrace-"))
FLIGHT_RECORDER_DIRECTORY = Path(tempfile.mkdtemp(prefix="rankwatch-fuzz-flight-recorder-"))


@bounded(300)
@given(targets.megatrace_logs())
def test_damaged_megatrace_logs_are_read_or_named_as_problems(logs):
    targets.read_megatrace(logs, MEGATRACE_DIRECTORY)


@bounded(300)
@given(targets.flight_recorder_dumps())
def test_a_damaged_flight_recorder_dump_is_a_problem_never_a_crash(dump):
    targets.read_flight_recorder(dump, FLIGHT_RECORDER_DIRECTORY)


MEGASCAN_DIRECTORY = Path(tempfile.mkdtemp(prefix="rankwatch-fuzz-megascan-"))


@bounded(300)
@given(targets.megascan_traces())
def test_a_damaged_megascan_trace_is_a_problem_or_a_megascan_error_never_a_crash(trace):
    targets.read_megascan(trace, MEGASCAN_DIRECTORY)


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
    with tempfile.TemporaryDirectory() as directory:
        logs = [("\n".join(line for line in targets.MEGATRACE_LINES if f"[Rank {r}]" in line) + "\n").encode()
                for r in (0, 1)]  # fmt: skip
        targets.read_megatrace(logs, Path(directory))
        assert len(targets.read_logs(Path(directory)).calls) == 10
    with tempfile.TemporaryDirectory() as directory:
        data = targets.json.dumps(targets.FLIGHT_RECORDER_DUMP).encode()
        targets.read_flight_recorder((data, False), Path(directory))
        assert sorted(targets.read_dumps(sorted(Path(directory).glob("nccl_trace_rank_*"))).ranks) == [0, 1]
    with tempfile.TemporaryDirectory() as directory:
        targets.read_megascan((targets.json.dumps(targets.MEGASCAN_RANK).encode(), False), Path(directory))
        trace = targets.read_traces(Path(directory))
        assert sorted(trace.ranks) == [0, 1] and len(trace.spans) == 4 and len(trace.calls) == 2
        aggregate = Path(directory) / "trace-aggregated.json"
        aggregate.write_text(targets.json.dumps(targets.MEGASCAN_AGGREGATE))
        assert sorted(targets.read_traces(aggregate).ranks) == [0, 1]
