"""Megatrace NCCL-patch logs: read them into a Trace, and write a Trace in their format.

One file per global rank, ``rank_<R>.log``, lines
``[save_count N] [sec.nsec] [Rank R] Fun <Op> Data <count> stream <0xptr> opCount <n> [groupHash <int64>]``.
A file holds several dumps (``save_count`` 1, 2, ...) of a ring of the last calls, so dumps overlap;
repeated lines are kept once. ``opCount`` counts per communicator; ``groupHash`` (newer format)
names the communicator, older logs lack it and their calls are keyed by stream, which tells the
communicators of one rank apart but cannot be matched across ranks. Only call times are logged:
the calls carry no return time (``Trace.has_returns`` is False).

Two tokenisers give the same calls and the same errors: a C extension (``_megatrace_tokenizer``,
files read in a thread pool as it releases the GIL) and whole-buffer numpy passes when the
extension is not importable; ``tokenizer()`` says which one is in use.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple, NoReturn, TypeVar

import numpy as np

from rankwatch.analysis.progress import Progress
from rankwatch.analysis.ring import MAX_GLOBAL_RANK, Op
from rankwatch.analysis.stream_match import match_streams
from rankwatch.analysis.topology import Layout
from rankwatch.analysis.trace import CALL_DTYPE, Communicator, RankSource, Trace

try:  # the C tokeniser, built at install time (analysis/_megatrace_tokenizer.c)
    from rankwatch.analysis import _megatrace_tokenizer as _native
except ImportError:  # an install without it: the numpy tokeniser, same results, 10-20x slower
    _native = None

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
    b"sendrecv": Op.SEND,  # ncclSendRecv: Data is the send count
}
OPS.update({b"nccl" + name: code for name, code in list(OPS.items()) if name != b"bcast"})
NAMES = {Op.ALLREDUCE: "AllReduce", Op.BROADCAST: "Broadcast", Op.REDUCE: "Reduce", Op.ALLGATHER: "AllGather",
         Op.REDUCESCATTER: "ReduceScatter", Op.ALLTOALL: "AlltoAll", Op.GATHER: "Gather", Op.SCATTER: "Scatter",
         Op.SEND: "Send", Op.RECV: "Recv"}  # fmt: skip


# The newer format (Megatrace's trace/intercept): optional [extra] fields, then [node_ip] [hostname],
# then every field bracketed: [Rank R] [PCI bus] [Func ncclOp] [Data n] [stream p] [opCount n] [groupHash 0x..]
BRACKETED_LINE = re.compile(
    rb"^(?:\[[^\]\n]*\] )*?\[([^\]\n]*)\] \[([^\]\n]*)\] \[save_count (\d+)\] \[(\d+\.\d+)\] \[Rank (-?\d+)\] "
    rb"\[PCI [^\]\n]*\] \[Func? (\w+)\] \[Data (\d+)\] \[stream (0x[0-9a-fA-F]+|\(nil\)|\d+)\] \[opCount (\d+)\]"
    rb"(?: \[groupHash (0x[0-9a-fA-F]+|-?\d+)\])?[ \t\r]*$",
    re.MULTILINE,
)


def _is_bracketed(head: bytes | bytearray) -> bool:
    first = bytes(head).lstrip()[:4096].split(b"\n", 1)[0]
    return not first.startswith(b"[save_count") and b"] [save_count " in first


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


_STREAM_MIX = 0x9E3779B97F4A7C15  # older format: comm = stream pointer * this ^ rank (C: STREAM_MIX)
_BAD_LINE, _BAD_NUMBER, _BAD_OP, _BAD_RANK = 1, 2, 3, 4  # statuses of _native.tokenize
MAX_RANK = (1 << 31) - 1  # NCCL ranks are C ints: a larger one is refused with its line, never wrapped


def tokenizer() -> str:
    """The tokeniser read_logs uses: "C" (the extension module) or "numpy" (the fallback)."""
    return "numpy" if _native is None else "C"


class _Columns(NamedTuple):
    """One file's calls column by column (the order of _native.tokenize's columns)."""

    rank: np.ndarray  # int32
    t_call: np.ndarray  # int64
    count: np.ndarray  # uint64
    seq: np.ndarray  # uint64
    op: np.ndarray  # uint8
    comm: np.ndarray  # uint64

    @property
    def rows(self) -> int:
        return len(self.t_call)

    def take(self, index: np.ndarray) -> _Columns:
        return _Columns(*(column[index] for column in self))


_COLUMN_DTYPES = (np.int32, np.int64, np.uint64, np.uint64, np.uint8, np.uint64)
_TEMPLATE = np.zeros(1, CALL_DTYPE)  # what Megatrace does not log
for _name in ("peer", "comm_rank", "comm_size", "t_return"):  # t_return: unknown, not pending
    _TEMPLATE[_name] = -1


def _ended(data: bytes) -> bytes:
    return data if data.endswith(b"\n") else data + b"\n"


def _bad_line(path: Path, data: bytes, at: int) -> MegatraceError:
    """The line holding byte `at` of data (which ends with a newline)."""
    number = data.count(b"\n", 0, at) + 1
    text = data[data.rfind(b"\n", 0, at) + 1 : data.find(b"\n", at)]
    return MegatraceError(f"{path}:{number}: not a Megatrace line: {text[:120]!r}")


def _unknown_op(path: Path, data: bytes, start: int, end: int) -> MegatraceError:
    name = data[start:end].decode(errors="replace")
    number = data.count(b"\n", 0, start) + 1
    return MegatraceError(f"{path}:{number}: unknown operation {name!r}")


def _rank_too_large(path: Path, data: bytes, start: int, end: int) -> MegatraceError:
    number = data.count(b"\n", 0, start) + 1
    rank = data[start:end].decode(errors="replace")
    return MegatraceError(
        f"{path}:{number}: rank {rank[:40]} does not fit in 32 bits (an NCCL rank is at most {MAX_RANK})"
    )


def _tokenize(path: Path, data: bytes) -> _Columns:
    """The numpy tokeniser: whole-buffer passes (no per-line Python); any malformed line names itself.
    data ends with a newline."""
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
        raise _bad_line(path, data, int(starts[first[np.argmax(bad)]]))

    try:
        s, e = field(4)
        wide_rank = _digits(buf, s, e - 1)
        too_large = (wide_rank > np.uint64(MAX_RANK)) | (e - 1 - s > len(str(MAX_RANK)))  # 20 digits may wrap
        rank = wide_rank.astype(np.int32)
        s, e = field(2)  # [sec.nsec] with nine nanosecond digits
        t_call = (_digits(buf, s + 1, e - 11) * np.uint64(10**9) + _digits(buf, e - 10, e - 1)).astype(np.int64)
        count = _digits(buf, *field(8))
        seq = _digits(buf, *field(12)) + np.uint64(1)  # opCount counts from 0; seq from 1
    except ValueError:
        _parse_slowly(path, data)
    if too_large.any():
        line = int(np.argmax(too_large))
        raise _rank_too_large(path, data, int(field(4)[0][line]), int(field(4)[1][line]) - 1)
    s, e = field(6)
    length = e - s
    keys = _op_key(length, buf[s], buf[s + np.minimum(3, length - 1)], buf[e - 1])
    position = np.minimum(np.searchsorted(_SORTED_KEYS, keys), len(_SORTED_KEYS) - 1)
    matched = _SORTED_KEYS[position] == keys
    if not matched.all():
        line = int(np.argmax(~matched))
        raise _unknown_op(path, data, int(s[line]), int(e[line]))
    op = _SORTED_CODES[position]

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
            group[rows] = (values * np.uint64(_STREAM_MIX)) ^ rank[rows].astype(np.uint64)
    except (ValueError, OverflowError):  # a groupHash that is no number, a stream that is no (64-bit) pointer
        _parse_slowly(path, data)
    return _Columns(rank, t_call, count, seq, op, group)


def _parse_slowly(path: Path, data: bytes) -> NoReturn:
    """Line-by-line check that names the first line the fast paths could not read."""
    for number, line in enumerate(data.splitlines(), 1):
        if line.strip() and not LINE.match(line):
            raise MegatraceError(f"{path}:{number}: not a Megatrace line: {line[:120]!r}")
    raise MegatraceError(f"{path}: a number does not fit in 64 bits")


def _first_occurrences(columns: _Columns) -> _Columns:
    """Overlapping dumps repeat lines: each call once (first occurrence, file order)."""
    t_call, seq, op, comm = columns.t_call, columns.seq, columns.op, columns.comm
    order = np.lexsort((np.arange(len(t_call)), t_call, op, seq, comm))
    t_call, op, seq, comm = t_call[order], op[order], seq[order], comm[order]
    repeat = np.zeros(len(order), bool)
    repeat[1:] = (comm[1:] == comm[:-1]) & (seq[1:] == seq[:-1]) & (op[1:] == op[:-1]) & (t_call[1:] == t_call[:-1])
    return columns.take(np.sort(order[~repeat]))


def _tokenize_native(path: Path, data: bytes | bytearray, size: int) -> _Columns:
    """The C tokeniser over data[:size], then its deduplication; errors as the numpy tokeniser words them."""
    status, start, end, *columns, odd = _native.tokenize(data, size, _SORTED_KEYS, _SORTED_CODES)
    if status:
        text = bytes(data[:size])
        if status == _BAD_LINE:
            raise _bad_line(path, _ended(text), start)
        if status == _BAD_OP:
            raise _unknown_op(path, text, start, end)
        if status == _BAD_RANK:
            raise _rank_too_large(path, text, start, end)
        _parse_slowly(path, _ended(text))
    if odd:  # older-format stream pointers the C code leaves to int(x, 16), like the numpy tokeniser
        rank, comm = np.frombuffer(columns[0], np.int32), np.frombuffer(columns[5], np.uint64)
        for row, s, e in odd:
            try:
                value = int(data[s:e], 16)
            except ValueError:
                _parse_slowly(path, _ended(bytes(data[:size])))
            if value >> 64:
                _parse_slowly(path, _ended(bytes(data[:size])))
            comm[row] = ((value * _STREAM_MIX) ^ int(rank[row])) & 0xFFFF_FFFF_FFFF_FFFF
    rows = _native.first_occurrences(*columns)
    return _Columns(*(np.frombuffer(c, t)[:rows] for c, t in zip(columns, _COLUMN_DTYPES, strict=True)))


def _read_into(path: Path, buffer: bytearray) -> tuple[bytearray, bytes | bytearray, int]:
    """The file's bytes: (the buffer, grown if need be; data; size), data being the buffer unless the
    file grew past it while read."""
    with open(path, "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        if len(buffer) <= size:  # room for one more byte, to see the end of the file
            buffer = bytearray(size + size // 8 + 4096)
        length = 0
        with memoryview(buffer) as view:
            while length < len(buffer) and (n := handle.readinto(view[length:])):
                length += n
        if length < len(buffer):
            return buffer, buffer, length
        data = bytes(buffer) + handle.read()
        return buffer, data, len(data)


class _Reader:
    """Reads and parses files, on several threads at once, with the C tokeniser when it is there.
    Read buffers go from file to file: a fresh one per file would cost a page fault per 4 KiB, more
    than the copy from the page cache."""

    def __init__(self) -> None:
        self._buffers: list[bytearray] = []  # free ones (list.pop and append are atomic)
        self.hosts: dict[Path, str] = {}  # from the bracketed format's [node_ip] [hostname] prefix

    def parse(self, path: Path) -> _Columns:
        """One Megatrace log: its calls in file order, repeats dropped."""
        if _native is None:
            data = path.read_bytes()
            if _is_bracketed(data):
                data = self._unbracket(path, data)
            return _first_occurrences(_tokenize(path, _ended(data)))
        buffer = self._buffers.pop() if self._buffers else bytearray()
        try:
            buffer, data, size = _read_into(path, buffer)
            if _is_bracketed(data[: min(size, 4096)]):
                data = self._unbracket(path, bytes(data[:size]))
                size = len(data)
            return _tokenize_native(path, data, size)
        finally:
            self._buffers.append(buffer)

    def _unbracket(self, path: Path, data: bytes) -> bytes:
        """The bracketed format rewritten line for line into the groupHash format (line numbers kept,
        so errors still name the file's own lines; a line that does not match is left to be named)."""
        hosts: set[bytes] = set()

        def rewrite(match: re.Match[bytes]) -> bytes:
            ip, host, save, when, rank, op, count, stream, op_count, group = match.groups()
            hosts.add(host if host != b"unknown" else ip)
            line = b"[save_count %s] [%s] [Rank %s] Fun %s Data %s stream %s opCount %s" % (
                save,
                when,
                rank,
                op,
                count,
                stream,
                op_count,
            )
            if group is None:
                return line
            value = int(group, 16) if group.startswith(b"0x") else int(group)
            return line + b" groupHash %d" % (value - (1 << 64) if value >= 1 << 63 else value)

        data = BRACKETED_LINE.sub(rewrite, data)
        if len(hosts) == 1:
            self.hosts[path] = hosts.pop().decode(errors="replace")
        return data

    def parse_or_problem(self, path: Path) -> _Columns | str:
        try:
            return self.parse(path)
        except (MegatraceError, OSError) as error:
            return str(error)


T = TypeVar("T")
R = TypeVar("R")


def _map(function: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
    """function over items, in order; on as many threads as there are CPUs when the C code (which
    releases the GIL) does the work."""
    items = list(items)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = 1 if _native is None else min(len(items), cpus)
    if workers <= 1:
        yield from map(function, items)
        return
    with ThreadPoolExecutor(workers) as pool:
        yield from pool.map(function, items)


def _by_rank_then_time(parts: list[_Columns]) -> list[_Columns]:
    """The parts' rows as a stable sort by (rank, t_call) of their concatenation would order them."""
    firsts = [int(part.rank[0]) for part in parts]
    if len(set(firsts)) == len(parts) and all((part.rank == r).all() for part, r in zip(parts, firsts, strict=True)):
        # usual case, one rank per file: files by rank, each by call time (already so, as a rule)
        ordered = []
        for _, part in sorted(zip(firsts, parts, strict=True), key=lambda pair: pair[0]):
            if (part.t_call[1:] < part.t_call[:-1]).any():
                part = part.take(np.argsort(part.t_call, kind="stable"))
            ordered.append(part)
        return ordered
    joined = _Columns(*(np.concatenate(column) for column in zip(*parts, strict=True)))
    return [joined.take(np.lexsort((joined.t_call, joined.rank)))]


def _fill(calls: np.ndarray, first: int, part: _Columns) -> None:
    """Rows first.. of calls: the template with the part's columns."""
    if _native is not None:
        fields = [
            (CALL_DTYPE.fields[name][1], column.itemsize, column)
            for name, column in zip(_Columns._fields, part, strict=True)
        ]
        _native.fill(calls, _TEMPLATE.tobytes(), first, fields)
        return
    rows = calls[first : first + part.rows]
    rows[...] = _TEMPLATE
    for name, column in zip(_Columns._fields, part, strict=True):
        rows[name] = column


def _members(part: _Columns) -> list[tuple[int, int]]:
    """The distinct (communicator, rank) pairs of a part."""
    rank = int(part.rank[0])
    if (part.rank == rank).all():
        comms = np.unique(part.comm) if _native is None else np.frombuffer(_native.distinct(part.comm), np.uint64)
        return [(comm_id, rank) for comm_id in comms.tolist()]
    order = np.lexsort((part.rank, part.comm))
    comm, ranks = part.comm[order], part.rank[order]
    new = np.r_[True, (comm[1:] != comm[:-1]) | (ranks[1:] != ranks[:-1])]
    return list(zip(comm[new].tolist(), ranks[new].tolist(), strict=True))


def _communicators(pairs: Iterable[list[tuple[int, int]]]) -> dict[int, Communicator]:
    """Members of each communicator (by groupHash, or by stream in the older format), id order."""
    members: dict[int, set[int]] = {}
    for part in pairs:
        for comm_id, member in part:
            members.setdefault(comm_id, set()).add(member)
    return {
        comm_id: Communicator(comm_id, len(ranks), dict(enumerate(sorted(ranks))))
        for comm_id, ranks in sorted(members.items())
    }


LOG_NAME = re.compile(r"\.log(\.\d+)?$")  # rank_<R>.log; <pod>_<time>_<pid>.log and its rotations .log.<n>


def log_files(directory: Path) -> list[Path]:
    """The Megatrace logs in a directory: rank_<R>.log, and any *.log / *.log.<n> that starts like one."""
    found = []
    for path in sorted(directory.iterdir()):
        if not path.is_file() or not LOG_NAME.search(path.name):
            continue
        if path.name.startswith("rank_"):
            found.append(path)
            continue
        with open(path, "rb") as handle:
            head = handle.read(4096).lstrip()
        if head.startswith(b"[save_count ") or _is_bracketed(head):
            found.append(path)
    return found


def read_logs(directory: str | Path, layout: Layout | None = None) -> Trace:
    """``layout``: the job's Megatron layout, which tells apart communicators of logs without groupHash.
    The rank of a call is the one its line names (files of the newer format are named by pod)."""
    directory = Path(directory)
    files = log_files(directory)
    if not files:
        raise FileNotFoundError(f"{directory}: no rank_*.log (or other Megatrace) logs")
    parts, ranks, problems, skipped = [], {}, [], []
    reader = _Reader()
    progress = Progress(len(files), "reading Megatrace logs")
    for path, result in zip(files, _map(reader.parse_or_problem, files), strict=True):
        progress.advance()
        if isinstance(result, str):
            problems.append(result)
            skipped.append(result)
            continue
        if not result.rows:
            continue
        highest = int(result.rank.max())
        if highest > MAX_GLOBAL_RANK:  # per-rank arrays of the analysis would be as long as this
            problems.append(f"{path}: rank {highest} is beyond the highest analysed ({MAX_GLOBAL_RANK}); skipped")
            skipped.append(problems[-1])
            continue
        rank = int(result.rank[0])
        if rank not in ranks or ranks[rank].node == "unknown":
            ranks[rank] = RankSource(rank, reader.hosts.get(path, "unknown"), -1, str(path))
        parts.append(result)
    progress.close()
    comms = _communicators(_map(_members, parts))
    ordered = _by_rank_then_time(parts)
    calls = np.empty(sum(part.rows for part in ordered), CALL_DTYPE)
    firsts = np.cumsum([0] + [part.rows for part in ordered])[:-1].tolist()
    for _ in _map(lambda job: _fill(calls, *job), zip(firsts, ordered, strict=True)):
        pass
    _match_unnamed_communicators(calls, comms, problems, layout)
    # the logs end where they end: no time after the last call is known to have passed without one
    end = int(calls["t_call"].max()) if len(calls) else 0
    return Trace(calls, ranks, comms, problems, skipped=skipped, has_returns=False, observed_until_ns=end)


def _match_unnamed_communicators(
    calls: np.ndarray, comms: dict[int, Communicator], problems: list[str], layout: Layout | None
) -> None:
    """Logs without groupHash key calls by (stream, rank): join the streams that are one communicator
    (stream_match.py), in place."""
    alone = np.array([comm_id for comm_id, comm in comms.items() if comm.size == 1], dtype=np.uint64)
    if len(comms) < 2 or not len(alone):
        return
    rows = np.flatnonzero(np.isin(calls["comm"], alone))
    mapping, matched, problem = match_streams(calls[rows], layout)
    if problem:
        problems.append(problem)
    if not mapping:
        return
    old = np.array(sorted(mapping), dtype=np.uint64)
    new = np.array([mapping[k] for k in sorted(mapping)], dtype=np.uint64)
    position = np.searchsorted(old, calls["comm"][rows])
    hit = (position < len(old)) & (old[np.minimum(position, len(old) - 1)] == calls["comm"][rows])
    calls["comm"][rows[hit]] = new[position[hit]]
    for comm_id in mapping:
        comms.pop(comm_id, None)
    comms.update(matched)
    problems.append(
        f"these logs name no communicator (no groupHash): {len(mapping)} streams matched into {len(matched)} "
        "communicators by their opCount sequences and call times"
    )


def _op_counts(calls: np.ndarray) -> np.ndarray:
    """Megatrace's opCount of one rank's calls: per communicator, from 0, one value for the calls of
    one ncclGroupStart/End (a grouped Send+Recv pair shares it)."""
    group = calls["group"]
    starts_op = np.r_[True, (group[1:] == 0) | (group[1:] != group[:-1])]
    counts = np.zeros(len(calls), np.int64)
    for comm_id in np.unique(calls["comm"]):
        rows = np.flatnonzero(calls["comm"] == comm_id)
        counts[rows] = np.cumsum(starts_op[rows]) - 1
    return counts


def write_logs(trace: Trace, directory: str | Path, save_count: int = 1, keep: np.ndarray | None = None) -> list[Path]:
    """Append the trace's calls as dump ``save_count`` of Megatrace logs (newer format, with groupHash).
    ``keep``: which calls the dump holds (a ring of the last calls); opCount still counts them all."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for rank in np.unique(trace.calls["rank"]).tolist():
        rows = trace.rows_of(rank)
        mine = trace.calls[rows]
        counts = _op_counts(mine)
        if keep is not None:
            mine, counts = mine[keep[rows]], counts[keep[rows]]
        lines = [
            f"[save_count {save_count}] [{t // 1_000_000_000}.{t % 1_000_000_000:09d}] [Rank {rank}] "
            f"Fun {NAMES[Op(op)]} Data {count} stream 0x0 opCount {op_count} groupHash {comm}\n"
            for t, op, count, op_count, comm in zip(
                mine["t_call"].tolist(), mine["op"].tolist(), mine["count"].tolist(), counts.tolist(),
                mine["comm"].astype(np.int64).tolist(), strict=True,
            )
        ]  # fmt: skip
        path = directory / f"rank_{rank}.log"
        with open(path, "a") as handle:
            handle.writelines(lines)
        written.append(path)
    return written
