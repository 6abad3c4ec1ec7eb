"""The parsers that read untrusted bytes, each wrapped as a property: whatever the input, the parser
returns a value or raises its own documented error (``ProtocolError``, ``RingError`` or a problem in
the trace, ``ConfigError``): never another exception, never a hang. Strategies start from valid inputs
and damage them (hypothesis shrinks a failure to its smallest form), and also try raw bytes.

Used by tests/fuzz (a bounded run in `make test`) and bench/fuzz_parsers.py (a longer one)."""

from __future__ import annotations

import contextlib
import copy
import gzip
import json
import pickle
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from hypothesis import strategies as st

from rankwatch import protocol
from rankwatch.alerting import mapping_resolver
from rankwatch.alerting.config import ConfigError, load_config, parse_config
from rankwatch.analysis.flight_recorder import read_dumps
from rankwatch.analysis.megascan import MegaScanError, read_traces
from rankwatch.analysis.megatrace import read_logs
from rankwatch.analysis.ring import HEADER_DTYPE, HEADER_SIZE, MAX_GLOBAL_RANK, RECORD_DTYPE, RingError, RingReader
from rankwatch.analysis.ring_loader import load_rings
from rankwatch.protocol import CommWindow, Quantiles, RankWindow, StallReport, WindowSummary

TRIED: Counter = Counter()
"""Inputs tried per target in this process (the figure in bench/RESULTS.md)."""


# -- the sidecar protocol ----------------------------------------------------------------------------


def valid_summary() -> WindowSummary:
    comm = CommWindow("00000000000000ab", 0, 4, 1, 10, 1, 10, 1, 0.5, {"AllReduce": 9, "Send": 1}, 0,
                      Quantiles(10, 0.001, 0.002, 0.003, 0.004), None, Quantiles(10, 0.1, 0.2, 0.3, 0.4))  # fmt: skip
    rank = RankWindow(3, 1, 42, "rank3.ring", True, 20, 0, 0, 0, 123, 0.25, [comm])
    return WindowSummary(1, "team-a", "llama", "llama-worker-0", "node-0", 0, 4, 7, 10**18, 10**18 + 5 * 10**9, 0,
                         [rank])  # fmt: skip


SUMMARY_DOCUMENT = asdict(valid_summary())
JSON_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40),
)  # fmt: skip
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=12), inner, max_size=5)),
    max_leaves=20,
)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) to a node of a JSON document."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*prefix, index))
    return found


@st.composite
def damaged_documents(draw: st.DrawFn, document: Any) -> Any:
    """``document`` with one to three nodes replaced by random JSON values, or deleted."""
    damaged = copy.deepcopy(document)
    for _ in range(draw(st.integers(1, 3))):
        paths = [path for path in _paths(damaged) if path]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = damaged
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(JSON_VALUES)
    return damaged


@st.composite
def protocol_bodies(draw: st.DrawFn) -> tuple[bytes, str | None]:
    """(request body, Content-Encoding) as a hostile or broken client might send them."""
    kind = draw(st.sampled_from(["damaged", "raw", "gzip-raw", "truncated-gzip", "text"]))
    if kind == "damaged":
        text = json.dumps(draw(damaged_documents(SUMMARY_DOCUMENT)))
        for constant in draw(st.lists(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "9" * 5000]),
                                      max_size=1)):  # fmt: skip
            text = text.replace("0.001", constant, 1)
        body = text.encode()
        return (gzip.compress(body), "gzip") if draw(st.booleans()) else (body, None)
    if kind == "raw":
        return draw(st.binary(max_size=2048)), draw(st.sampled_from([None, "gzip", "identity", "br", ""]))
    if kind == "gzip-raw":
        return gzip.compress(draw(st.binary(max_size=2048))), "gzip"
    if kind == "truncated-gzip":
        body = protocol.encode(valid_summary())
        return body[: draw(st.integers(0, len(body)))], "gzip"
    return draw(st.text(max_size=500)).encode("utf-8", "surrogatepass"), None


def decode_protocol(body: bytes, encoding: str | None) -> None:
    """The collector's path for a body: decode, then parse as either message."""
    TRIED["protocol"] += 1
    try:
        raw = protocol.decode_body(body, encoding)
    except protocol.ProtocolError:
        return
    for parse in (protocol.parse_summary, protocol.parse_stall):
        try:
            message = parse(raw)
        except protocol.ProtocolError:
            continue
        assert isinstance(message, WindowSummary | StallReport)
        json.dumps(asdict(message), allow_nan=False)  # what was taken is plain JSON again: no NaN, no infinity


# -- ring files --------------------------------------------------------------------------------------


def valid_ring(capacity: int = 8, claimed: int = 5) -> bytes:
    header = np.zeros(1, HEADER_DTYPE)
    header["magic"], header["version"], header["header_size"], header["record_size"] = b"RWRING\0\0", 1, 4096, 128
    header["capacity"], header["next"], header["global_rank"], header["hostname"] = capacity, claimed, 3, b"node-a"
    slots = np.zeros(capacity, RECORD_DTYPE)
    for index in range(max(0, claimed - capacity), claimed):
        slot = slots[index % capacity]
        slot["stamp"], slot["seq"], slot["op"], slot["state"] = 2 * index + 2, index + 1, 1, 2
        slot["comm_id"], slot["nranks"], slot["t_call_ns"], slot["t_return_ns"] = (
            0xAB,
            4,
            index * 1000,
            index * 1000 + 5,
        )
    return header.tobytes().ljust(HEADER_SIZE, b"\0") + slots.tobytes()


VALID_RING = valid_ring()


@st.composite
def ring_files(draw: st.DrawFn) -> bytes:
    """A valid ring with bytes overwritten (header fields above all), truncated or extended."""
    data = bytearray(VALID_RING)
    for _ in range(draw(st.integers(1, 6))):
        where = draw(st.one_of(st.integers(0, 64), st.integers(0, len(data) - 1)))  # the header's fields first
        chunk = draw(st.binary(min_size=1, max_size=8))
        data[where : where + len(chunk)] = chunk
    cut = draw(st.one_of(st.none(), st.integers(0, len(data))))
    if cut is not None:
        del data[cut:]
    return bytes(data)


def read_ring_file(data: bytes, directory: Path) -> None:
    """The sidecar's reader and the analysis loader on one (damaged) ring file."""
    TRIED["ring"] += 1
    path = directory / "fuzz.ring"
    path.write_bytes(data)
    try:
        with RingReader(path) as reader:
            snapshot = reader.read()
            assert len(snapshot.records) <= reader.capacity
    except RingError:
        pass
    trace = load_rings([path])  # never raises: an unreadable ring is a problem in the trace
    assert len(trace.calls) <= 8 or trace.problems is not None


# -- Megatrace logs and flight-recorder dumps (the analysis' other inputs) -----------------------------

MEGATRACE_LINES = [
    f"[save_count {i}] [1700000000.{i:09d}] [Rank {rank}] Fun AllReduce Data 1024 stream 0x7f00 opCount {i} "
    f"groupHash 1234567"
    for rank in (0, 1)
    for i in range(1, 6)
]


@st.composite
def megatrace_logs(draw: st.DrawFn) -> list[bytes]:
    """Two ranks' logs, lines damaged (bytes overwritten, cut, duplicated) or replaced by random bytes."""
    logs = []
    for rank in (0, 1):
        lines = [line.encode() for line in MEGATRACE_LINES if f"[Rank {rank}]" in line]
        for _ in range(draw(st.integers(0, 4))):
            index = draw(st.integers(0, len(lines) - 1))
            line = bytearray(lines[index])
            action = draw(st.sampled_from(["overwrite", "cut", "random", "digits"]))
            if action == "overwrite":
                where = draw(st.integers(0, max(0, len(line) - 1)))
                line[where : where + 4] = draw(st.binary(min_size=1, max_size=4))
            elif action == "cut":
                del line[draw(st.integers(0, len(line))) :]
            elif action == "digits":  # a field's number made huge or negative
                line = bytearray(bytes(line).replace(b"1024", draw(st.sampled_from([b"9" * 30, b"-1", b"0" * 40]))))
            else:
                line = bytearray(draw(st.binary(max_size=120)))
            lines[index] = bytes(line)
        logs.append(b"\n".join(lines) + b"\n")
    return logs


def read_megatrace(logs: list[bytes], directory: Path) -> None:
    """The analysis reader (the C tokeniser when built) on damaged logs: problems, never a crash."""
    TRIED["megatrace"] += 1
    for old in directory.glob("*.log"):
        old.unlink()
    for rank, data in enumerate(logs):
        (directory / f"rank_{rank}.log").write_bytes(data)
    trace = read_logs(directory)
    assert len(trace.calls) <= sum(data.count(b"\n") + 1 for data in logs)
    assert ((trace.calls["rank"] >= 0) & (trace.calls["rank"] <= MAX_GLOBAL_RANK)).all(), "a rank wrapped"


def _flight_recorder_dump(rank: int) -> dict[str, Any]:
    entries = [
        {"record_id": seq, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": seq,
         "p2p_seq_id": 0, "op_id": seq, "profiling_name": "nccl:all_reduce", "input_sizes": [[1024, 4]],
         "input_dtypes": ["Float"], "output_sizes": [[1024, 4]], "output_dtypes": ["Float"], "state": "completed",
         "time_created_ns": 10**18 + seq * 10**7, "time_discovered_started_ns": 10**18 + seq * 10**7 + 100,
         "time_discovered_completed_ns": 10**18 + seq * 10**7 + 5 * 10**6, "duration_ms": 5.0, "timeout_ms": 600000,
         "retired": True, "is_p2p": False, "frames": []}
        for seq in range(1, 4)
    ]  # fmt: skip
    return {"version": "2.10", "rank": rank, "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": [0, 1]}},
            "pg_status": {}, "entries": entries}  # fmt: skip


FLIGHT_RECORDER_DUMP = _flight_recorder_dump(0)


@st.composite
def flight_recorder_dumps(draw: st.DrawFn) -> tuple[bytes, bool]:
    """(a damaged dump of rank 0 as JSON or pickle, whether it is a pickle), or random bytes."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=600)), draw(st.booleans())
    document = draw(damaged_documents(FLIGHT_RECORDER_DUMP))
    as_pickle = draw(st.booleans())
    data = pickle.dumps(document) if as_pickle else json.dumps(document).encode()
    if draw(st.booleans()):  # and a few bytes of the encoding itself damaged
        data = bytearray(data)
        where = draw(st.integers(0, len(data) - 1))
        data[where : where + 2] = draw(st.binary(min_size=1, max_size=2))
        data = bytes(data)
    return data, as_pickle


def read_flight_recorder(dump: tuple[bytes, bool], directory: Path) -> None:
    """The flight-recorder reader (restricted unpickler included) on a damaged dump beside a good one."""
    TRIED["flight recorder"] += 1
    data, _ = dump
    (directory / "nccl_trace_rank_0").write_bytes(data)
    (directory / "nccl_trace_rank_1").write_bytes(json.dumps(_flight_recorder_dump(1)).encode())
    trace = read_dumps(sorted(directory.glob("nccl_trace_rank_*")))
    assert 1 in trace.ranks, "the good dump is read whatever the other holds"


# -- MegaScan traces ---------------------------------------------------------------------------------


def _megascan_rank(tp: int) -> list[dict[str, Any]]:
    """One rank's records as MegaScan writes them with --trace-granularity full: an iteration holding a
    forward with a TP AllReduce inside, a send and a backward."""
    where = {"dp_rk": 0, "pp_rk": 0, "tp_rk": tp, "dev": tp, "g_rk": tp}
    return [{"name": "iteration", "ph": "B", "pad_before": 0}] + [
        {**record, **where} for record in [
            {"name": "forward", "ph": "B", "rel_ts": 100}, {"name": "_reduce", "ph": "B", "rel_ts": 200},
            {"name": "_reduce", "ph": "E", "rel_ts": 300, "group": [1 - tp]},
            {"microbatch": 0, "model_chunk": 0, "pp_rank": 0, "name": "forward", "ph": "E", "rel_ts": 400},
            {"name": "backward", "ph": "B", "rel_ts": 500},
            {"microbatch": 0, "model_chunk": 0, "pp_rank": 0, "name": "backward", "ph": "E", "rel_ts": 900},
            {"name": "iteration", "ph": "E", "rel_ts": 1000, "duration_cuda": 1000, "duration_wall": 1100},
        ]
    ]  # fmt: skip


MEGASCAN_RANK = _megascan_rank(0)
MEGASCAN_AGGREGATE = [
    {"name": "forward", "ph": "X", "ts": 1.5, "dur": 3, "pid": 0, "tid": 0,
     "args": {"iteration": 0, "microbatch": 0, "model_chunk": 0, "dp_rk": 0, "pp_rk": 0, "tp_rk": 0, "g_rk": 0}},
    {"name": "backward", "ph": "B", "ts": 5, "pid": 1, "tid": 0, "args": {"iteration": 0}},
    {"name": "backward", "ph": "E", "ts": 9, "pid": 1, "tid": 0, "args": {"iteration": 0, "microbatch": 0}},
    {"name": "iteration end", "ph": "i", "ts": 10, "pid": 1, "tid": 0, "args": {"iteration": 0}},
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "DP0-PP0-TP1"}},
]  # fmt: skip


@st.composite
def megascan_traces(draw: st.DrawFn) -> tuple[bytes, bool]:
    """(a damaged rank file or aggregated trace, whether it is the aggregate), or random bytes."""
    aggregate = draw(st.booleans())
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=600)), aggregate
    document = draw(damaged_documents(MEGASCAN_AGGREGATE if aggregate else MEGASCAN_RANK))
    return json.dumps(document).encode(), aggregate


def read_megascan(trace: tuple[bytes, bool], directory: Path) -> None:
    """The MegaScan reader on a damaged rank file beside a good one (the good one is read whatever the
    other holds), or on a damaged aggregate (read, or refused with a MegaScanError)."""
    TRIED["megascan"] += 1
    data, aggregate = trace
    if aggregate:
        (directory / "trace-aggregated.json").write_bytes(data)
        with contextlib.suppress(MegaScanError):
            read_traces(directory / "trace-aggregated.json")
        return
    (directory / "benchmark-data-0-pipeline-0-tensor-0.json").write_bytes(data)
    (directory / "benchmark-data-0-pipeline-0-tensor-1.json").write_text(json.dumps(_megascan_rank(1)))
    assert 1 in read_traces(directory).ranks, "the good rank file is read whatever the other holds"


# -- the alerting config -----------------------------------------------------------------------------

SECRETS = mapping_resolver({"bot": {"url": "https://open.feishu.cn/open-apis/bot/v2/hook/x", "key": "s"},
                            "intake": {"token": "t"}})  # fmt: skip
CONFIG_DOCUMENT = {
    "receivers": [
        {"name": "team", "feishu": {"webhook_url": {"secretKeyRef": {"name": "bot", "key": "url"}},
                                    "secret": {"secretKeyRef": {"name": "bot", "key": "key"}}, "mentions": ["all"]}},
        {"name": "hook", "webhook": {"url": "http://127.0.0.1:1/hook"}},
    ],
    "route": {"receiver": "team", "group_by": ["alertname"], "group_wait": "1s", "routes": [
        {"matchers": ['level=~"P0|P1"'], "receiver": "hook", "continue": True}]},
    "inhibit_rules": [{"source_matchers": ['alertname="NodeDown"'], "target_matchers": ['level="P2"'],
                       "equal": ["node"]}],
    "silences": [{"matchers": ['node=~"gpu-.*"'], "ends_at": "2030-01-01T00:00:00Z", "comment": "x"}],
    "storm": {"max_alerts": 50, "window": "1s"},
    "delivery": {"timeout": "2s", "attempts": 3},
    "report": {"receiver": "team", "weekday": "monday", "time": "09:00"},
    "intake": {"bearer_token": {"secretKeyRef": {"name": "intake", "key": "token"}}},
    "store": {"configMap": "rankwatch-alerts"},
}  # fmt: skip


@st.composite
def config_texts(draw: st.DrawFn) -> str:
    """Alerting config YAML: the valid document damaged, or arbitrary text."""
    if draw(st.integers(0, 9)):
        return yaml.safe_dump(draw(damaged_documents(CONFIG_DOCUMENT)))
    return draw(st.text(max_size=300))


def load_alerting_config(text: str) -> None:
    TRIED["alerting config"] += 1
    with contextlib.suppress(ConfigError):
        load_config(text, SECRETS)


def check_valid_config_loads() -> None:
    parse_config(copy.deepcopy(CONFIG_DOCUMENT), SECRETS)
