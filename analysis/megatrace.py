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

from rankwatch.analysis.progress import Progress
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


def _digits(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Decimal numbers in buf[starts[i]:ends[i]] (at most 20 digits): Horner's rule, column by column."""
    lengths = ends - starts
    value = np.zeros(len(starts), np.uint64)
    last = len(buf) - 1
    for offset in range(int(lengths.max()) if len(lengths) else 0):
        inside = offset < lengths
        digit = buf[np.minimum(starts + offset, last)].astype(np.int64) - 48
        if ((digit < 0) | (digit > 9))[inside].any():
            raise ValueError("non-digit")
        value = np.where(inside, value * np.uint64(10) + digit.astype(np.uint64), value)
    return value


def _op_key(length: np.ndarray, first: np.ndarray, fourth: np.ndarray, last: np.ndarray) -> np.ndarray:
    """Operation names differ in length, first, fourth or last letter (case ignored: | 0x20)."""
    lower = np.int64(0x20)
    return (
        (length.astype(np.int64) << 24)
        | ((first.astype(np.int64) | lower) << 16)
        | ((fourth.astype(np.int64) | lower) << 8)
        | (last.astype(np.int64) | lower)
    )


_OP_KEYS = {
    int(_op_key(np.array([len(n)]), np.array([n[0]]), np.array([n[min(3, len(n) - 1)]]), np.array([n[-1]]))[0]): code
    for n, code in OPS.items()
}
_SORTED_KEYS = np.array(sorted(_OP_KEYS), dtype=np.int64)
_SORTED_CODES = np.array([_OP_KEYS[key] for key in _SORTED_KEYS.tolist()], dtype=np.uint8)


def _parse(path: Path) -> np.ndarray:
    """Tokenise the whole file with numpy (no per-line Python); any malformed line names itself."""
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        data += b"\n"
    buf = np.frombuffer(data, np.uint8)
    separator = (buf == 32) | (buf == 10) | (buf == 9) | (buf == 13)
    token = ~separator
    starts = np.flatnonzero(token & np.r_[True, separator[:-1]])
    ends = np.flatnonzero(token & np.r_[separator[1:], True]) + 1
    # a token opens a line when the byte before it is a newline (or it is the first)
    opens_line = np.r_[True, buf[starts[1:] - 1] == 10] if len(starts) else np.zeros(0, bool)
    line_of = np.cumsum(opens_line) - 1
    counts = np.bincount(line_of) if len(starts) else np.zeros(0, np.int64)
    first = np.flatnonzero(opens_line)
    lines = np.arange(len(first))

    def field(k: int) -> tuple[np.ndarray, np.ndarray]:
        return starts[first + k], ends[first + k]

    bad = ~np.isin(counts, (13, 15))
    if not bad.any():
        for k, letter in ((0, b"["), (3, b"["), (5, b"F"), (7, b"D"), (9, b"s"), (11, b"o")):
            bad |= buf[field(k)[0]] != letter[0]
    if bad.any():
        at = int(starts[first[np.argmax(bad)]])
        number = data.count(b"\n", 0, at) + 1
        text = data[data.rfind(b"\n", 0, at) + 1 : data.find(b"\n", at)]
        raise MegatraceError(f"{path}:{number}: not a Megatrace line: {text[:120]!r}")

    calls = np.zeros(len(lines), CALL_DTYPE)
    try:
        s, e = field(4)
        calls["rank"] = _digits(buf, s, e - 1).astype(np.int64)
        s, e = field(2)  # [sec.nsec] with nine nanosecond digits
        calls["t_call"] = (_digits(buf, s + 1, e - 11) * np.uint64(10**9) + _digits(buf, e - 10, e - 1)).astype(
            np.int64
        )
        calls["count"] = _digits(buf, *field(8))
        calls["seq"] = _digits(buf, *field(12)) + np.uint64(1)  # opCount counts from 0; seq from 1
    except ValueError:
        return _parse_slowly(path, data)
    s, e = field(6)
    length = e - s
    keys = _op_key(length, buf[s], buf[s + np.minimum(3, length - 1)], buf[e - 1])
    position = np.minimum(np.searchsorted(_SORTED_KEYS, keys), len(_SORTED_KEYS) - 1)
    matched = _SORTED_KEYS[position] == keys
    if not matched.all():
        line = int(np.argmax(~matched))
        name = data[int(s[line]) : int(e[line])].decode(errors="replace")
        number = data.count(b"\n", 0, int(s[line])) + 1
        raise MegatraceError(f"{path}:{number}: unknown operation {name!r}")
    calls["op"] = _SORTED_CODES[position]

    has_hash = counts == 15
    group = np.zeros(len(lines), np.uint64)
    try:
        if has_hash.any():
            rows = np.flatnonzero(has_hash)
            s, e = starts[first[rows] + 14], ends[first[rows] + 14]
            negative = buf[s] == ord("-")
            magnitude = _digits(buf, s + negative, e)
            group[rows] = np.where(negative, (~magnitude) + np.uint64(1), magnitude)  # two's complement
        if not has_hash.all():
            # no groupHash: a per-rank stream key (never equal across ranks, so never compared across them)
            rows = np.flatnonzero(~has_hash)
            s, e = field(10)
            streams = [data[int(a) : int(b)] for a, b in zip(s[rows], e[rows], strict=True)]
            values = np.array([int(x, 16) if x.startswith(b"0x") else 0 for x in streams], dtype=np.uint64)
            group[rows] = (values * np.uint64(0x9E3779B97F4A7C15)) ^ calls["rank"][rows].astype(np.uint64)
    except (ValueError, OverflowError):  # a groupHash that is no number, a stream that is no (64-bit) pointer
        return _parse_slowly(path, data)
    calls["comm"] = group
    return _finish(calls)


def _parse_slowly(path: Path, data: bytes) -> np.ndarray:
    """Line-by-line fallback that names the first line the fast path could not read."""
    for number, line in enumerate(data.splitlines(), 1):
        if line.strip() and not LINE.match(line):
            raise MegatraceError(f"{path}:{number}: not a Megatrace line: {line[:120]!r}")
    raise MegatraceError(f"{path}: a number does not fit in 64 bits")


def _finish(calls: np.ndarray) -> np.ndarray:
    calls["peer"] = -1
    calls["comm_rank"] = -1
    calls["comm_size"] = -1
    calls["t_return"] = -1  # unknown, not pending
    # Overlapping dumps repeat lines: keep each call once (first occurrence, file order).
    order = np.lexsort((np.arange(len(calls)), calls["t_call"], calls["op"], calls["seq"], calls["comm"]))
    keys = calls[order]
    repeat = np.zeros(len(calls), bool)
    repeat[1:] = (
        (keys["comm"][1:] == keys["comm"][:-1])
        & (keys["seq"][1:] == keys["seq"][:-1])
        & (keys["op"][1:] == keys["op"][:-1])
        & (keys["t_call"][1:] == keys["t_call"][:-1])
    )
    return calls[np.sort(order[~repeat])]


def read_logs(directory: str | Path) -> Trace:
    directory = Path(directory)
    files = sorted(directory.glob("rank_*.log"))
    if not files:
        raise FileNotFoundError(f"{directory}: no rank_*.log files")
    parts, ranks, problems = [], {}, []
    progress = Progress(len(files), "reading Megatrace logs")
    for path in files:
        progress.advance()
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
    progress.close()
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
