"""One columnar form for every trace source: flat arrays of calls, sorted by rank then call time.

Detectors work on ``Trace.calls`` (a numpy structured array, one row per NCCL call) and
``Trace.comms`` (communicator id -> members); they never loop over records in Python. Sources that
cannot be read are listed in ``Trace.problems`` with the reason; the other ranks are still analysed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rankwatch.analysis.findings import comm_label
from rankwatch.analysis.ring import Op
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
        ("t_return", "<i8"),  # 0: never returned (GPU-timed: its GPU work never ended)
        ("gpu_start", "<i8"),
        ("gpu_end", "<i8"),
        ("group", "<u8"),
    ]
)


class Calls:
    """The calls as columns: one contiguous array per field of ``CALL_DTYPE``.

    A detector reads a few fields of millions of calls; held as 82-byte records, every such pass reads
    all 82 bytes of each call (2.65 GB at 16k ranks), held as columns only the fields it reads. Indexed
    like the structured array it replaces: ``calls["t_call"]`` is a column (writable: it is the
    calls' own), ``calls[mask]`` / ``calls[rows]`` / ``calls[a:b]`` are calls (copies, or views for a
    slice), ``calls[i]`` is one call as a record."""

    __slots__ = ("_columns",)
    dtype = CALL_DTYPE

    def __init__(self, columns: dict[str, np.ndarray]) -> None:
        self._columns = columns

    @classmethod
    def empty(cls, n: int) -> Calls:
        return cls({name: np.empty(n, CALL_DTYPE[name]) for name in CALL_DTYPE.names})

    @classmethod
    def from_records(cls, records: np.ndarray) -> Calls:
        """Columns of a ``CALL_DTYPE`` structured array (the readers of small sources build those)."""
        return cls({name: np.ascontiguousarray(records[name]) for name in CALL_DTYPE.names})

    def records(self) -> np.ndarray:
        """The calls as a ``CALL_DTYPE`` structured array (a copy)."""
        out = np.empty(len(self), CALL_DTYPE)
        for name, column in self._columns.items():
            out[name] = column
        return out

    def tobytes(self) -> bytes:
        """The calls' bytes as a ``CALL_DTYPE`` structured array holds them (comparing two readers)."""
        return self.records().tobytes()

    def __len__(self) -> int:
        return len(self._columns["rank"])

    @property
    def size(self) -> int:
        return len(self)

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    @property
    def nbytes(self) -> int:
        return sum(column.nbytes for column in self._columns.values())

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return self._columns[key]
        if isinstance(key, (int, np.integer)):
            return self[np.array([key])].records()[0]
        return Calls({name: column[key] for name, column in self._columns.items()})

    def __iter__(self) -> Iterator[np.void]:
        """One call at a time, as records (a few thousand stalled calls: one conversion, not one each)."""
        return iter(self.records())

    def __setitem__(self, key: str, value: Any) -> None:
        self._columns[key][...] = value

    def copy(self) -> Calls:
        return Calls({name: column.copy() for name, column in self._columns.items()})

    def tolist(self) -> list[tuple]:
        """One tuple per call, fields in ``CALL_DTYPE`` order (as a structured array's ``tolist``)."""
        return list(zip(*(self._columns[name].tolist() for name in CALL_DTYPE.names), strict=True))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        records = self.records()
        return records if dtype is None else records.astype(dtype)

    def __repr__(self) -> str:
        return f"Calls({len(self)} calls)"


# GPU compute a tracer recorded around whole pieces of work (MegaScan: the forward or backward of one
# microbatch of one model chunk), on each rank's own timeline: ranks are compared by durations only
FORWARD, BACKWARD = 0, 1
SPAN_DTYPE = np.dtype(
    [
        ("rank", "<i4"),
        ("iteration", "<i4"),
        ("kind", "u1"),  # FORWARD or BACKWARD
        ("microbatch", "<i4"),
        ("chunk", "<i4"),  # model chunk (virtual pipeline stage)
        ("start", "<i8"),
        ("end", "<i8"),
        ("comm_ns", "<i8"),  # time inside communication recorded within the span (its waits among them)
    ]
)
ITERATION_DTYPE = np.dtype(
    [
        ("rank", "<i4"),
        ("iteration", "<i4"),
        ("start", "<i8"),
        ("cuda_ns", "<i8"),  # 0: not recorded
        ("wall_ns", "<i8"),  # 0: not recorded
    ]
)

COLLECTIVE_OPS = np.array(
    [Op.ALLREDUCE, Op.BROADCAST, Op.REDUCE, Op.ALLGATHER, Op.REDUCESCATTER, Op.ALLTOALL, Op.GATHER, Op.SCATTER],
    dtype=np.uint8,
)
P2P_OPS = np.array([Op.SEND, Op.RECV], dtype=np.uint8)


@dataclass(frozen=True)
class Frame:
    """One Python frame of the stack a call was made from (flight-recorder dumps carry them)."""

    file: str
    line: int
    function: str


@dataclass(frozen=True)
class RankSource:
    rank: int
    node: str
    pid: int
    path: str
    world_size: int | None = None  # what the source says the job's world size is (ring header), if it does
    gpu_index: int | None = None  # the CUDA device the rank ran on, when the source records it (ring header v2)
    gpu_uuid: str | None = None


@dataclass
class Communicator:
    id: int
    size: int
    members: dict[int, int] = field(default_factory=dict)  # rank in communicator -> global rank
    parent: int = 0


@dataclass
class Trace:
    calls: Calls  # a CALL_DTYPE structured array given here is held as columns
    ranks: dict[int, RankSource]
    comms: dict[int, Communicator]
    problems: list[str] = field(default_factory=list)
    # inputs not read at all (each with its reason; also among the problems): an analysis missing them
    # cannot call the job healthy
    skipped: list[str] = field(default_factory=list)
    has_returns: bool = True  # False for sources that log only call times (Megatrace)
    # the calls return when their collective is done on the host (gloo on CPU): call times are the ranks'
    # own pace, not launches onto a GPU that runs behind the host (late_windows.py)
    calls_block_on_host: bool = False
    layout: Layout | None = None  # Megatron layout, when given
    ranks_per_node: int | None = None  # names nodes node-<rank // n> when sources do not
    # t_return 0 means "still inside" even without return times (flight-recorder dumps record completion)
    pending_known: bool = False
    # (rank, comm, seq, op) -> the Python stack of that call, innermost first, where the source records it
    stacks: dict[tuple[int, int, int, int], tuple[Frame, ...]] = field(default_factory=dict)
    # rank -> ranks it may be exchanging sends/receives with that the source does not record (gloo)
    unrecorded_partners: dict[int, set[int]] = field(default_factory=dict)
    # compute spans (SPAN_DTYPE) and iterations (ITERATION_DTYPE) where the source records them (MegaScan)
    spans: np.ndarray | None = None
    iterations: np.ndarray | None = None
    # until when the sources are known to have watched the job (a dump's writing, a timeout that ran
    # out): a call older than that by the stall threshold waited that long. None: they were live until
    # the analysis (rings). Logs that simply end were watched only until their last call.
    observed_until_ns: int | None = None
    # (rank, comm, seq): collectives a rank is stuck inside, where the source tells it apart from waiting
    # there (gloo: its work outlived its timeout unretired while another member's timed out)
    stuck_inside: set[tuple[int, int, int]] = field(default_factory=set)
    _bounds: tuple[Calls, np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)
    # the calls, the mask of those grouped and their instances (instances.instances_of): detectors share one
    _instances: tuple[Calls, np.ndarray, Any] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.calls, Calls):
            self.calls = Calls.from_records(np.asarray(self.calls, CALL_DTYPE))

    def rows_of(self, rank: int) -> slice:
        """The calls of one rank (calls are sorted by rank): a slice."""
        if self._bounds is None or self._bounds[0] is not self.calls:
            ranks = self.calls["rank"]
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
def durations(calls: Calls) -> np.ndarray:
    """Time inside each call, ns: on the GPU when timed (a real NCCL call returns to the host at once),
    else return minus call time. Clock-skew free: both ends are one rank's clock."""
    gpu_start, gpu_end = calls["gpu_start"], calls["gpu_end"]
    inside = calls["t_return"] - calls["t_call"]
    timed = gpu_start > 0
    timed &= gpu_end > 0
    if timed.any():
        np.subtract(gpu_end, gpu_start, out=inside, where=timed)
    return inside


def is_collective(op: np.ndarray) -> np.ndarray:
    """``np.isin(op, COLLECTIVE_OPS)`` as two comparisons (the collectives' codes are consecutive): a
    pass over millions of calls, not a sort."""
    return (op >= Op.ALLREDUCE) & (op <= Op.SCATTER)


def is_p2p(op: np.ndarray) -> np.ndarray:
    """``np.isin(op, P2P_OPS)`` as two comparisons."""
    return (op == Op.SEND) | (op == Op.RECV)
