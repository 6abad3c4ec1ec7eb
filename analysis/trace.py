"""One columnar form for every trace source: flat arrays of calls, sorted by rank then call time.

Detectors work on ``Trace.calls`` (a numpy structured array, one row per NCCL call) and
``Trace.comms`` (communicator id -> members); they never loop over records in Python. Sources that
cannot be read are listed in ``Trace.problems`` with the reason; the other ranks are still analysed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rankwatch.analysis.findings import comm_label
from rankwatch.analysis.progress import Progress
from rankwatch.analysis.ring import RAW_RECORD, RECORD_DTYPE, Op, RingError, RingReader, peek_header
from rankwatch.analysis.topology import Layout

CALL_DTYPE = np.dtype(
    [
        ("rank", "<i4"),  # global rank
        ("comm", "<u8"),
        ("seq", "<u8"),
        ("op", "u1"),
        ("count", "<u8"),
        ("dtype", "u1"),
        ("peer", "<i4"),  # rank in the communicator (send/recv peer, root), -1
        ("comm_rank", "<i4"),
        ("comm_size", "<i4"),
        ("t_call", "<i8"),
        ("t_return", "<i8"),  # 0: never returned
        ("gpu_start", "<i8"),
        ("gpu_end", "<i8"),
        ("group", "<u8"),
    ]
)

COLLECTIVE_OPS = np.array(
    [Op.ALLREDUCE, Op.BROADCAST, Op.REDUCE, Op.ALLGATHER, Op.REDUCESCATTER, Op.ALLTOALL, Op.GATHER, Op.SCATTER],
    dtype=np.uint8,
)
P2P_OPS = np.array([Op.SEND, Op.RECV], dtype=np.uint8)


@dataclass(frozen=True)
class RankSource:
    rank: int
    node: str
    pid: int
    path: str


@dataclass
class Communicator:
    id: int
    size: int
    members: dict[int, int] = field(default_factory=dict)  # rank in communicator -> global rank
    parent: int = 0


@dataclass
class Trace:
    calls: np.ndarray
    ranks: dict[int, RankSource]
    comms: dict[int, Communicator]
    problems: list[str] = field(default_factory=list)
    has_returns: bool = True  # False for sources that log only call times (Megatrace)
    layout: Layout | None = None  # Megatron layout, when given
    ranks_per_node: int | None = None  # names nodes node-<rank // n> when sources do not
    _bounds: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)

    def rows_of(self, rank: int) -> slice:
        """The calls of one rank (calls are sorted by rank): a slice."""
        if self._bounds is None or self._bounds[0] is not self.calls:
            ranks = np.ascontiguousarray(self.calls["rank"])
            starts = np.flatnonzero(np.r_[True, ranks[1:] != ranks[:-1]]) if len(ranks) else np.zeros(0, np.int64)
            self._bounds = (self.calls, ranks[starts], np.r_[starts, len(ranks)])
        _, ranks, starts = self._bounds
        index = int(np.searchsorted(ranks, rank))
        if index == len(ranks) or ranks[index] != rank:
            return slice(0, 0)
        return slice(int(starts[index]), int(starts[index + 1]))

    @property
    def end_ns(self) -> int:
        """The latest time any rank recorded: "now" for an offline trace."""
        if not len(self.calls):
            return 0
        return int(max(self.calls["t_call"].max(), self.calls["t_return"].max()))

    def node_of(self, rank: int) -> str:
        source = self.ranks.get(rank)
        if source and source.node != "unknown":
            return source.node
        return f"node-{rank // self.ranks_per_node}" if self.ranks_per_node else "unknown"

    def label(self, rank: int) -> str:
        """'rank 13 (tp 5, dp 1, pp 0) on node gpu-node-1', as much as is known."""
        where = f" ({self.layout.describe(rank)})" if self.layout else ""
        return f"rank {rank}{where} on node {self.node_of(rank)}"

    def comm_name(self, comm_id: int) -> str:
        """'TP group 00ab…' when the layout tells what the members are, else 'communicator 00ab…'."""
        label = comm_label(comm_id)
        comm = self.comms.get(comm_id)
        if self.layout and comm:
            kind = self.layout.group_kind(set(comm.members.values()))
            if kind in ("TP", "DP", "PP"):
                return f"{kind} group {label}"
            if kind == "world":
                return f"world communicator {label}"
        return f"communicator {label}"


# The calls' fields where a ring record keeps them: converting a record is one structured copy.
_RECORD_SOURCES = ("global_rank", "comm_id", "seq", "op", "count", "dtype", "peer", "rank", "nranks", "t_call_ns",
                   "t_return_ns", "gpu_start_ns", "gpu_end_ns", "group_id")  # fmt: skip
_RECORD_AS_CALL = np.dtype(
    {
        "names": list(CALL_DTYPE.names),
        "formats": [CALL_DTYPE[name] for name in CALL_DTYPE.names],
        "offsets": [RECORD_DTYPE.fields[source][1] for source in _RECORD_SOURCES],
        "itemsize": RECORD_DTYPE.itemsize,
    }
)


def _header_of(path: Path) -> tuple[int, int] | str:
    """(global rank, records the ring holds) or the reason it cannot be read."""
    try:
        rank, held = peek_header(path)
    except RingError as error:
        return str(error)
    if rank < 0:
        return f"{path}: the ring does not say its global rank (RANK was unset); skipped"
    return rank, held


def load_rings(paths: Iterable[str | Path]) -> Trace:
    """Read ring files (one per process); unreadable ones become problems, not failures.

    Rings are read in rank order into one preallocated array, converted in batches, so memory is
    the calls themselves plus one batch."""
    ranks: dict[int, RankSource] = {}
    comms: dict[int, Communicator] = {}
    problems: list[str] = []
    chosen: list[tuple[int, Path]] = []
    first_path: dict[int, Path] = {}
    upper = 0
    for path in sorted(map(Path, paths)):
        found = _header_of(path)
        if isinstance(found, str):
            problems.append(found)
        elif found[0] in first_path:
            problems.append(f"{path}: rank {found[0]} also comes from {first_path[found[0]]}; kept the first")
        else:
            first_path[found[0]] = path
            chosen.append((found[0], path))
            upper += found[1]
    calls = np.empty(upper, CALL_DTYPE)
    filled = 0
    progress = Progress(len(chosen), "reading rings")
    for rank, path in sorted(chosen):
        progress.advance()
        try:
            with RingReader(path, load=True) as reader:
                snapshot = reader.read()
        except RingError as error:
            problems.append(str(error))
            continue
        header, records = snapshot.header, snapshot.records
        ranks[rank] = RankSource(rank, header.hostname, header.pid, str(path))
        if snapshot.torn:
            problems.append(f"{path}: {snapshot.torn} torn or in-flight records skipped")
        op = records["op"]
        traced = (op > Op.NONE) & (op < Op.COMM_INIT)
        lifecycle = np.flatnonzero(~traced)
        if len(lifecycle):
            _learn_communicators(records[lifecycle], rank, comms)
            if lifecycle[-1] == len(lifecycle) - 1:  # creations first, as usual: a slice, no copy
                records = records[len(lifecycle) :]
            else:
                records = records.view(RAW_RECORD)[traced].view(RECORD_DTYPE)
        _members_from_calls(records, rank, comms)
        if len(records) > 1 and (np.diff(records["t_call_ns"]) < 0).any():  # threads interleaved
            records = records[np.argsort(records["t_call_ns"], kind="stable")]
        out = calls[filled : filled + len(records)]
        out[:] = records.view(_RECORD_AS_CALL)
        out["rank"] = rank  # the header's word, as for the communicators
        filled += len(records)
    progress.close()
    calls = calls[:filled]
    return Trace(calls, ranks, comms, problems)


def _learn_communicators(lifecycle: np.ndarray, rank: int, comms: dict[int, Communicator]) -> None:
    """Members and parents from the creation records (init, split, shrink) rings still hold."""
    created = lifecycle["op"] <= Op.COMM_SHRINK
    for comm_id, comm_rank, size, parent in zip(
        lifecycle["comm_id"][created].tolist(), lifecycle["rank"][created].tolist(),
        lifecycle["nranks"][created].tolist(), lifecycle["aux"][created].tolist(), strict=True,
    ):  # fmt: skip
        comm = comms.setdefault(comm_id, Communicator(comm_id, size))
        comm.members[comm_rank] = rank
        comm.parent = parent


def _members_from_calls(records: np.ndarray, rank: int, comms: dict[int, Communicator]) -> None:
    """Communicators whose creation fell out of a wrapped ring: a rank's place in each communicator
    from its calls there (one place per communicator, so its first call tells it)."""
    ids = records["comm_id"]
    for comm_id in np.unique(ids).tolist():
        comm = comms.get(comm_id)
        if comm is not None and rank in comm.members.values():
            continue  # its creation record said it
        first = records[int(np.argmax(ids == comm_id))]
        comm = comms.setdefault(comm_id, Communicator(comm_id, int(first["nranks"])))
        comm.members.setdefault(int(first["rank"]), rank)


def load_path(path: str | Path) -> Trace:
    """A directory of rings (e.g. a trace directory or a `rankwatch simulate --out`), of Megatrace
    logs (rank_<R>.log) or of PyTorch flight-recorder dumps (<prefix>rank_<R>), or one ring file."""
    path = Path(path)
    if path.is_dir():
        rings = sorted(path.glob("*.ring"))
        if rings:
            return load_rings(rings)
        if any(path.glob("rank_*.log")):
            from rankwatch.analysis.megatrace import read_logs

            return read_logs(path)
        dumps = [p for p in path.iterdir() if p.is_file() and re.search(r"rank_\d+(\.\w+)?$", p.name)]
        if dumps:
            from rankwatch.analysis.flight_recorder import read_dumps

            return read_dumps(dumps)
        raise FileNotFoundError(
            f"{path}: no *.ring files, Megatrace rank_<R>.log files or flight-recorder *rank_<R> dumps"
        )
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    return load_rings([path])
