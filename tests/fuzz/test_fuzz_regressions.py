"""Crashes the fuzzing (and the hostile-input test) found, kept as they were found: each input is
refused with the parser's own error, as the property requires. All three were accepted or crashed
before this change: the protocol took NaN (and every median it entered became NaN), a number of more
than 4,300 digits raised Python's ValueError (a 500 from the collector), and deep nesting raised
RecursionError."""

from __future__ import annotations

import gzip
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import fuzz_targets as targets

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
