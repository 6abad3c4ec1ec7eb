"""The protocol module both sides import: round trips, and bodies a collector must refuse clearly."""

from __future__ import annotations

import dataclasses
import gzip
import json

import pytest

from rankwatch import protocol
from rankwatch.protocol import (
    CommPosition,
    CommWindow,
    ProtocolError,
    Quantiles,
    RankPosition,
    RankScheduling,
    RankWindow,
    StallReport,
    WindowSummary,
)


def summary() -> WindowSummary:
    comm = CommWindow(
        comm_id="00000000c0ffee00", comm_rank=1, comm_size=8, first_entered=11, last_entered=20, first_completed=10,
        last_completed=19, in_flight=1, oldest_in_flight_s=0.002, calls={"AllReduce": 10}, failed=0,
        wait=Quantiles(10, 0.001, 0.002, 0.003, 0.004), gap=Quantiles(9, 0.01, 0.01, 0.01, 0.02), gpu=None,
    )  # fmt: skip
    rank = RankWindow(
        global_rank=3, local_rank=3, pid=41, ring="rankwatch-n-41.ring", alive=True, records=10, torn=0,
        overwritten=0, lost_updates=0, last_call_ns=1_700_000_000_000_000_000, step_time_s=0.1, comms=[comm],
        scheduling=RankScheduling(cpu_s=1.2, run_delay_s=0.35, involuntary_switches=420),
    )  # fmt: skip
    return WindowSummary(
        schema=protocol.SCHEMA_VERSION, namespace="team-a", job="llama", pod="llama-worker-0", node="gpu-node-1",
        replica_index=0, expected_ranks=8, window=7, start_ns=1, end_ns=2, dropped_summaries=3, ranks=[rank],
        cpu_pressure=0.42,
    )  # fmt: skip


def stall() -> StallReport:
    position = RankPosition(
        global_rank=3, local_rank=3, pid=41, ring="r.ring", alive=True, stall="in_flight", last_call_ns=5,
        silent_s=2.0, comms=[CommPosition("00000000c0ffee00", 1, 8, 20, 19, 1, 2.5, "AllReduce", 20)],
    )  # fmt: skip
    return StallReport(
        schema=protocol.SCHEMA_VERSION, namespace="team-a", job="llama", pod="p", node="n", replica_index=0,
        detected_ns=9, sensitivity_s=2.0, stalled_ranks=[3], summary="rank 3 waits", megatrace_dir="/t/megatrace",
        positions=[position],
    )  # fmt: skip


def test_messages_round_trip_through_gzip_json():
    for message, parse in ((summary(), protocol.parse_summary), (stall(), protocol.parse_stall)):
        body = protocol.encode(message)
        assert body[:2] == b"\x1f\x8b", "gzip"
        assert parse(protocol.decode_body(body, "gzip")) == message


def test_paths_and_bearer_header():
    assert protocol.summaries_path("team-a", "llama") == "/v1/jobs/team-a/llama/summaries"
    assert protocol.stalls_path("team-a", "llama") == "/v1/jobs/team-a/llama/stalls"
    assert protocol.token_of(protocol.bearer("abc")) == "abc"
    assert protocol.token_of("Basic abc") is None and protocol.token_of(None) is None
    assert protocol.token_of("Bearer ") is None


def document(**changes) -> bytes:
    data = dataclasses.asdict(summary())
    data.update(changes)
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "WindowSummary: not JSON"),
        (b"[1, 2]", "expected a JSON object, got list"),
        (document(schema=3), "schema 3, this side reads 1, 2"),
        (document(schema=True), "schema True, this side reads 1, 2"),
        (document(window="7"), "WindowSummary.window: expected an integer, got '7'"),
        (document(window=True), "WindowSummary.window: expected an integer, got True"),
        (document(extra=1), "WindowSummary: unknown field 'extra'"),
        (document(ranks=[{"global_rank": 1}]), "WindowSummary.ranks[0]: missing field"),
        (document(ranks="none"), "WindowSummary.ranks: expected a list"),
    ],
)
def test_bad_summaries_are_refused_naming_the_field(body, message):
    for parse in (protocol.parse_summary, protocol.checked_summary):
        with pytest.raises(ProtocolError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse(body)


def test_a_schema_1_summary_without_the_host_figures_still_parses():
    """Sidecars of the previous release send schema 1: no scheduling, no CPU pressure."""
    data = dataclasses.asdict(summary())
    data["schema"] = 1
    del data["cpu_pressure"]
    del data["ranks"][0]["scheduling"]
    for body in (json.dumps(data).encode(), gzip.decompress(gzip.compress(json.dumps(data).encode()))):
        parsed = protocol.parse_summary(body)
        assert parsed.schema == 1 and parsed.cpu_pressure is None and parsed.ranks[0].scheduling is None
        assert parsed.ranks[0].comms == summary().ranks[0].comms
    data["ranks"][0]["scheduling"] = {"cpu_s": 1.0, "run_delay_s": "long", "involuntary_switches": 3}
    with pytest.raises(ProtocolError, match=r"ranks\[0\]\.scheduling\.run_delay_s: expected a number"):
        protocol.parse_summary(json.dumps(data).encode())
    data["ranks"][0]["scheduling"] = {"cpu_s": 1.0, "run_delay_s": 0.5}
    with pytest.raises(ProtocolError, match="missing field 'involuntary_switches'"):
        protocol.parse_summary(json.dumps(data).encode())


def nested(change) -> bytes:
    data = dataclasses.asdict(summary())
    change(data)
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (nested(lambda d: d["ranks"][0]["comms"][0]["wait"].update(extra=1)), r"wait: unknown field 'extra'"),
        (nested(lambda d: d["ranks"][0].update(records=True)), r"records: expected an integer, got True"),
        (nested(lambda d: d["ranks"][0]["comms"][0].update(calls={"AllReduce": 1.5})), r"calls\.AllReduce"),
        (nested(lambda d: d.update(cpu_pressure=None, schema=3)), "schema 3"),
        (json.dumps(dataclasses.asdict(summary())).replace("0.42", "1e999").encode(), "out of range"),
    ],
)
def test_the_fast_parser_refuses_what_the_checks_refuse_and_names_it(body, message):
    """Summaries are checked by msgspec first (in C); whatever it refuses, deep inside too, is refused with
    the field named, as before; by the collector's check without the dataclasses (``checked_summary``) too."""
    for parse in (protocol.parse_summary, protocol.checked_summary):
        with pytest.raises(ProtocolError, match=message):
            parse(body)


def test_the_fast_parser_builds_the_same_messages_as_the_checks():
    """Ints where floats are due become floats, optional fields absent in schema 1 take their defaults, and
    an integer too large for msgspec (beyond 64 bits) is still taken, as by the JSON module."""
    data = dataclasses.asdict(summary())
    data["ranks"][0]["step_time_s"] = 1
    data["ranks"][0]["last_call_ns"] = 2**70
    parsed = protocol.parse_summary(json.dumps(data).encode())
    assert parsed.ranks[0].step_time_s == 1.0 and type(parsed.ranks[0].step_time_s) is float
    assert parsed.ranks[0].last_call_ns == 2**70
    assert (
        dataclasses.replace(parsed.ranks[0], step_time_s=0.1, last_call_ns=summary().ranks[0].last_call_ns)
        == (summary().ranks[0])
    )


def fields_of(value: object) -> object:
    """Every field of a message, read by attribute as a reader does (dataclass or checked mirror alike)."""
    if isinstance(value, list):
        return [fields_of(item) for item in value]
    if isinstance(value, dict):
        return {key: fields_of(item) for key, item in value.items()}
    if hasattr(value, "__dataclass_fields__") or hasattr(value, "__struct_fields__"):
        names = getattr(value, "__struct_fields__", None) or [field.name for field in dataclasses.fields(value)]
        return {name: fields_of(getattr(value, name)) for name in names}
    return value


def test_the_checked_summary_reads_as_the_parsed_one():
    """Without its dataclasses (the collector's path), a summary reads the same, field by field: GPU times,
    host figures, defaults of schema 1, ints made floats, an integer beyond 64 bits (the slow path's)."""
    gpu = dataclasses.replace(summary().ranks[0].comms[0], gpu=Quantiles(10, 0.5, 0.6, 0.7, 0.8), wait=None)
    schema_1 = dataclasses.asdict(dataclasses.replace(summary(), schema=1))
    del schema_1["cpu_pressure"], schema_1["ranks"][0]["scheduling"]
    schema_1["ranks"][0]["step_time_s"] = 1
    huge = dataclasses.asdict(summary())
    huge["ranks"][0]["last_call_ns"] = 2**70
    bodies = [
        json.dumps(dataclasses.asdict(summary())).encode(),
        json.dumps(dataclasses.asdict(dataclasses.replace(summary(), ranks=[
            dataclasses.replace(summary().ranks[0], comms=[gpu, summary().ranks[0].comms[0]])]))).encode(),
        json.dumps(schema_1).encode(),
        json.dumps(huge).encode(),
    ]  # fmt: skip
    for body in bodies:
        parsed, checked = protocol.parse_summary(body), protocol.checked_summary(body)
        assert fields_of(checked) == fields_of(parsed)
    assert not dataclasses.is_dataclass(protocol.checked_summary(bodies[0])), "no dataclass built on the fast path"


def test_nested_field_errors_name_the_path():
    data = dataclasses.asdict(summary())
    data["ranks"][0]["comms"][0]["wait"]["p50"] = "fast"
    with pytest.raises(ProtocolError, match=r"WindowSummary\.ranks\[0\]\.comms\[0\]\.wait\.p50: expected a number"):
        protocol.parse_summary(json.dumps(data).encode())


def test_oversized_and_bomb_bodies_are_refused():
    with pytest.raises(ProtocolError, match=r"compressed body of .* over the limit"):
        protocol.decode_body(protocol.GZIP_MAGIC + b"x" * protocol.MAX_BODY_BYTES, "gzip")
    with pytest.raises(ProtocolError, match="over the limit"):
        protocol.decode_body(b"x" * (protocol.MAX_DECODED_BYTES + 1))
    bomb = gzip.compress(b" " * (protocol.MAX_DECODED_BYTES + 10))
    assert len(bomb) < protocol.MAX_BODY_BYTES
    with pytest.raises(ProtocolError, match="decompresses to more than"):
        protocol.decode_body(bomb, "gzip")
    with pytest.raises(ProtocolError, match="not valid gzip"):
        protocol.decode_body(protocol.GZIP_MAGIC + b"garbage", "gzip")
    assert protocol.decode_body(b"{}", "gzip") == b"{}", "already decompressed by the server framework"
    with pytest.raises(ProtocolError, match="Content-Encoding 'br'"):
        protocol.decode_body(b"{}", "br")
    assert protocol.decode_body(b"{}", None) == b"{}"
