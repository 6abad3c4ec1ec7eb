"""Crashes the fuzzing (and the hostile-input test) found, kept as they were found: each input is
refused with the parser's own error, as the property requires. All three were accepted or crashed
before this change: the protocol took NaN (and every median it entered became NaN), a number of more
than 4,300 digits raised Python's ValueError (a 500 from the collector), and deep nesting raised
RecursionError."""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict

import fuzz_targets as targets
import pytest

from rankwatch import protocol

DOCUMENT = json.dumps(asdict(targets.valid_summary()))


@pytest.mark.parametrize(
    ("replacement", "message"),
    [
        ("NaN", "NaN is not a number this protocol accepts"),
        ("Infinity", "Infinity is not a number this protocol accepts"),
        ("1e999", "out of range"),
        ("9" * 5000, "not JSON: Exceeds the limit"),
    ],
)
def test_found_numbers_are_refused_as_protocol_errors(replacement, message):
    body = DOCUMENT.replace('"p50": 0.001', f'"p50": {replacement}', 1).encode()
    with pytest.raises(protocol.ProtocolError, match=message):
        protocol.parse_summary(protocol.decode_body(gzip.compress(body), "gzip"))
    targets.decode_protocol(body, None)  # the property holds on it


def test_deep_nesting_is_a_protocol_error():
    with pytest.raises(protocol.ProtocolError, match="nested too deeply"):
        protocol.parse_summary(b"[" * 100_000)


def _dump_with(**changes) -> dict:
    document = targets.copy.deepcopy(targets.FLIGHT_RECORDER_DUMP)
    entry_changes = changes.pop("entry", {})
    document.update(changes)
    document["entries"][1].update(entry_changes)
    return document


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"\x80\x04}K\x01a.", "not a readable flight-recorder pickle"),  # APPEND on a dict: AttributeError
        (json.dumps(_dump_with(pg_config=True)).encode(), "pg_config is not a mapping"),  # AttributeError
        (json.dumps(_dump_with(entry={"duration_ms": 8223372036835})).encode(), "is not a duration"),  # Overflow
        (targets.pickle.dumps(_dump_with(entry={"duration_ms": float("nan")})), "is not a duration"),
        (targets.pickle.dumps(_dump_with(entry={"time_created_ns": float("inf")})), "is not a number"),
        (json.dumps(_dump_with(entry={"collective_seq_id": -1})).encode(), "collective_seq_id -1 is negative"),
        (
            json.dumps(_dump_with(entry={"profiling_name": "nccl:send 0->99999999999", "p2p_seq_id": 1})).encode(),
            "peer 99999999999 is beyond",
        ),
    ],
)
def test_found_flight_recorder_dumps_are_problems(tmp_path, data, problem):
    """Found by bench/fuzz_parsers.py (APPEND on a dict, pg_config, the duration, the negative sequence
    number; the others by reading the code the crashes pointed at): each crashed the reader with
    AttributeError, OverflowError or ValueError."""
    targets.read_flight_recorder((data, False), tmp_path)
    trace = targets.read_dumps(sorted(tmp_path.glob("nccl_trace_rank_*")))
    assert any(problem in text for text in trace.problems), trace.problems
