"""Megatrace NCCL-patch logs: read them into a Trace, and write a Trace in their format.

One file per global rank, ``rank_<R>.log``, lines
``[save_count N] [sec.nsec] [Rank R] Fun <Op> Data <count> stream <0xptr> opCount <n> [groupHash <int64>]``.
A file holds several dumps (``save_count`` 1, 2, ...) of a ring of the last calls, so dumps overlap;
repeated lines are kept once. ``opCount`` counts per communicator; ``groupHash`` (newer format)
names the communicator, older logs lack it and their calls are keyed by stream, which tells the
communicators of one rank apart but cannot be matched across ranks. Only call times are logged:
the calls carry no return time (``Trace.has_returns`` is False).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from rankwatch.analysis.ring import Op
from rankwatch.analysis.trace import CALL_DTYPE, Communicator, RankSource, Trace

LINE = re.compile(
    rb"^\[save_count (\d+)\] \[(\d+)\.(\d+)\] \[Rank (-?\d+)\] Fun (\w+) Data (\d+) "
    rb"stream (0x[0-9a-fA-F]+|\(nil\)|\d+) opCount (\d+)(?: groupHash (-?\d+))?[ \t]*$",
    re.MULTILINE,
)
OPS = {
    b"allreduce": Op.ALLREDUCE,
    b"broadcast": Op.BROADCAST,
    b"bcast": Op.BROADCAST,
    b"reduce": Op.REDUCE,
    b"allgather": Op.ALLGATHER,
    b"reducescatter": Op.REDUCESCATTER,
    b"alltoall": Op.ALLTOALL,
    b"gather": Op.GATHER,
    b"scatter": Op.SCATTER,
    b"send": Op.SEND,
    b"recv": Op.RECV,
}
NAMES = {Op.ALLREDUCE: "AllReduce", Op.BROADCAST: "Broadcast", Op.REDUCE: "Reduce", Op.ALLGATHER: "AllGather",
         Op.REDUCESCATTER: "ReduceScatter", Op.ALLTOALL: "AlltoAll", Op.GATHER: "Gather", Op.SCATTER: "Scatter",
         Op.SEND: "Send", Op.RECV: "Recv"}  # fmt: skip


class MegatraceError(ValueError):
    """A log line that is not in Megatrace's format; the message names file and line."""


def _parse(path: Path) -> np.ndarray:
    data = path.read_bytes()
    rows = LINE.findall(data)
    lines = data.split(b"\n")
    if len(rows) != len(lines) - lines.count(b""):
        for number, line in enumerate(data.splitlines(), 1):
            if line.strip() and not LINE.match(line):
                raise MegatraceError(f"{path}:{number}: not a Megatrace line: {line[:120]!r}")
    calls = np.zeros(len(rows), CALL_DTYPE)
    if not rows:
        return calls
    columns = list(zip(*rows, strict=True))
    calls["rank"] = np.array(columns[3], dtype=np.int64)
    ops = [OPS.get(name.lower()) for name in columns[4]]
    if None in ops:
        bad = columns[4][ops.index(None)]
        raise MegatraceError(f"{path}: unknown operation {bad.decode(errors='replace')!r}")
    calls["op"] = np.array(ops, dtype=np.uint8)
    calls["count"] = np.array(columns[5], dtype=np.uint64)
    calls["seq"] = np.array(columns[7], dtype=np.uint64) + 1  # opCount counts from 0; seq from 1
    calls["t_call"] = np.array(columns[1], dtype=np.int64) * 1_000_000_000 + np.array(columns[2], dtype=np.int64)
    group = np.array([int(g) if g else 0 for g in columns[8]], dtype=np.int64).view(np.uint64)
    streams = np.array([int(s, 16) if s.startswith(b"0x") else 0 for s in columns[6]], dtype=np.uint64)
    # no groupHash: a per-rank stream key (never equal across ranks, so never compared across them)
    fallback = (streams * np.uint64(0x9E3779B97F4A7C15)) ^ calls["rank"].astype(np.uint64)
    calls["comm"] = np.where(group != 0, group, fallback)
    calls["peer"] = -1
    calls["comm_rank"] = -1
    calls["comm_size"] = -1
    calls["t_return"] = -1  # unknown, not pending
    # Overlapping dumps repeat lines: keep each call once.
    _, first = np.unique(calls[["comm", "seq", "op", "t_call"]].copy(), return_index=True)
    return calls[np.sort(first)]


def read_logs(directory: str | Path) -> Trace:
    directory = Path(directory)
    files = sorted(directory.glob("rank_*.log"))
    if not files:
        raise FileNotFoundError(f"{directory}: no rank_*.log files")
    parts, ranks, problems = [], {}, []
    for path in files:
        try:
            calls = _parse(path)
        except (MegatraceError, OSError) as error:
            problems.append(str(error))
            continue
        if not len(calls):
            continue
        rank = int(calls["rank"][0])
        ranks[rank] = RankSource(rank, "unknown", -1, str(path))
        parts.append(calls)
    calls = np.concatenate(parts) if parts else np.zeros(0, CALL_DTYPE)
    calls = calls[np.lexsort((calls["t_call"], calls["rank"]))]
    comms: dict[int, Communicator] = {}
    for comm_id in np.unique(calls["comm"]):
        members = np.unique(calls["rank"][calls["comm"] == comm_id])
        comms[int(comm_id)] = Communicator(int(comm_id), len(members), dict(enumerate(members.tolist())))
    return Trace(calls, ranks, comms, problems, has_returns=False)


def write_logs(trace: Trace, directory: str | Path, save_count: int = 1) -> list[Path]:
    """Append the trace's calls as dump ``save_count`` of Megatrace logs (newer format, with groupHash)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for rank in np.unique(trace.calls["rank"]):
        mine = trace.calls[trace.calls["rank"] == rank]
        lines = [
            f"[save_count {save_count}] [{t // 1_000_000_000}.{t % 1_000_000_000:09d}] [Rank {rank}] "
            f"Fun {NAMES[Op(op)]} Data {count} stream 0x0 opCount {seq - 1} groupHash {int(np.int64(comm))}\n"
            for t, op, count, seq, comm in zip(
                mine["t_call"].tolist(), mine["op"].tolist(), mine["count"].tolist(), mine["seq"].tolist(),
                mine["comm"].astype(np.int64).tolist(), strict=True,
            )
        ]  # fmt: skip
        path = directory / f"rank_{rank}.log"
        with open(path, "a") as handle:
            handle.writelines(lines)
        written.append(path)
    return written
