"""Where each local rank is: per communicator, the last collective entered and completed, and the calls
in flight with their ages; and each poll's calls as a few flat columns for the window summary.

Communicators get small per-ring indices (one ``searchsorted`` against the few ids seen so far), so
progress is kept in arrays indexed by communicator and updated with ``np.maximum.at``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankwatch.analysis.ring import Op, State, take
from rankwatch.protocol import OP_NAMES, CommPosition, RankPosition
from rankwatch.sidecar.ring_tail import RingTail, TailBatch

NO_SEQ = 0  # sequence numbers start at 1


def comm_hex(comm_id: int) -> str:
    return f"{comm_id:016x}"


def is_collective(ops: np.ndarray) -> np.ndarray:
    """Ops 1..8 are collectives: their seq is comparable across members (send/recv count per peer)."""
    return (ops >= Op.ALLREDUCE) & (ops <= Op.SCATTER)


def is_call(ops: np.ndarray) -> np.ndarray:
    """NCCL communication calls (not communicator lifecycle records)."""
    return (ops >= Op.ALLREDUCE) & (ops <= Op.RECV)


def calls_of(records: np.ndarray) -> np.ndarray:
    calls = is_call(records["op"])
    return records if calls.all() else take(records, calls)


class CommTable:
    """Communicator ids of one ring -> indices 0, 1, ... in order of first appearance."""

    def __init__(self) -> None:
        self.ids = np.empty(0, np.uint64)
        self._sorted = np.empty(0, np.uint64)
        self._index_of_sorted = np.empty(0, np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    def index(self, comm_ids: np.ndarray) -> np.ndarray:
        if not len(comm_ids):
            return np.empty(0, np.int64)
        if len(self.ids):
            position = np.minimum(np.searchsorted(self._sorted, comm_ids), len(self._sorted) - 1)
            known = self._sorted[position] == comm_ids
            if known.all():
                return self._index_of_sorted[position]
            fresh = comm_ids[~known]
        else:
            fresh = comm_ids
        _, first = np.unique(fresh, return_index=True)
        self.ids = np.concatenate([self.ids, fresh[np.sort(first)]])
        self._index_of_sorted = np.argsort(self.ids, kind="stable")
        self._sorted = self.ids[self._index_of_sorted]
        return self.index(comm_ids)


@dataclass(frozen=True)
class Entered:
    """Calls first seen in one poll, as columns (comm = index in the ring's CommTable)."""

    comm: np.ndarray
    op: np.ndarray
    seq: np.ndarray
    count: np.ndarray
    t_call: np.ndarray


@dataclass(frozen=True)
class Finished:
    """Calls that finished in one poll, as columns; wait and gpu are -1 when unknown."""

    comm: np.ndarray
    op: np.ndarray
    seq: np.ndarray
    wait: np.ndarray  # t_return - t_call, ns
    gpu: np.ndarray  # gpu_end - gpu_start, ns
    failed: np.ndarray


class RankProgress:
    """One ring's progress since the sidecar began reading it."""

    def __init__(self, tail: RingTail) -> None:
        self.tail = tail
        self.comms = CommTable()
        self.comm_rank = np.empty(0, np.int32)
        self.comm_size = np.empty(0, np.int32)
        self.last_entered = np.empty(0, np.uint64)  # NO_SEQ: none yet
        self.last_completed = np.empty(0, np.uint64)
        self.last_done_ns = 0
        """When this rank's work last completed: the latest GPU end of a GPU-timed call, else host return."""

    def _index(self, records: np.ndarray) -> np.ndarray:
        index = self.comms.index(records["comm_id"])
        grow = len(self.comms) - len(self.comm_rank)
        if grow:
            self.comm_rank = np.concatenate([self.comm_rank, np.full(grow, -1, np.int32)])
            self.comm_size = np.concatenate([self.comm_size, np.full(grow, -1, np.int32)])
            self.last_entered = np.concatenate([self.last_entered, np.zeros(grow, np.uint64)])
            self.last_completed = np.concatenate([self.last_completed, np.zeros(grow, np.uint64)])
            unknown = self.comm_rank[index] < 0
            self.comm_rank[index[unknown]] = records["rank"][unknown]
            self.comm_size[index[unknown]] = records["nranks"][unknown]
        return index

    def update(self, batch: TailBatch) -> tuple[Entered, Finished]:
        entered, finished = calls_of(batch.entered), calls_of(batch.finished)
        comm_e, comm_f = self._index(entered), self._index(finished)
        op_e, op_f = entered["op"], finished["op"]
        seq_e, seq_f = entered["seq"], finished["seq"]
        collective_e, collective_f = is_collective(op_e), is_collective(op_f)
        np.maximum.at(self.last_entered, comm_e[collective_e], seq_e[collective_e])
        np.maximum.at(self.last_completed, comm_f[collective_f], seq_f[collective_f])
        t_call, t_return = finished["t_call_ns"], finished["t_return_ns"]
        failed = finished["state"] == State.FAILED
        gpu_start, gpu_end = finished["gpu_start_ns"], finished["gpu_end_ns"]
        done = np.where(gpu_end > 0, gpu_end, t_return)[~failed]
        if len(done):
            self.last_done_ns = max(self.last_done_ns, int(done.max()))
        return (
            Entered(comm_e, op_e, seq_e, entered["count"], entered["t_call_ns"]),
            Finished(
                comm_f,
                op_f,
                seq_f,
                np.where((t_return > 0) & ~failed, t_return - t_call, -1),
                np.where((gpu_start > 0) & (gpu_end >= gpu_start), gpu_end - gpu_start, -1),
                failed,
            ),
        )

    def in_flight(self) -> np.ndarray:
        """Calls entered and not finished (host return, or GPU end when GPU-timed), oldest first."""
        pending = self.tail.pending
        return pending[np.argsort(pending["t_call_ns"], kind="stable")]

    def waiting_since_ns(self, t_call_ns: int) -> int:
        """Since when a call in flight has been holding this rank up: its call, or the rank's last
        completed work if later. An asynchronous GPU's host enqueues calls long before the GPU reaches
        them; what stops on a hang is completion, so a call queued behind work that keeps completing
        is not old."""
        return max(t_call_ns, self.last_done_ns)

    def oldest_in_flight_age_s(self, now_ns: int) -> float | None:
        pending = self.tail.pending
        if not len(pending):
            return None
        return (now_ns - self.waiting_since_ns(int(pending["t_call_ns"].min()))) / 1e9

    def silent_s(self, now_ns: int) -> float:
        return max(0.0, (now_ns - self.tail.last_activity_ns) / 1e9)

    def seq_or_none(self, values: np.ndarray, index: int) -> int | None:
        return int(values[index]) if index < len(values) and values[index] != NO_SEQ else None

    def position(self, now_ns: int, alive: bool, stall: str | None) -> RankPosition:
        header = self.tail.header
        flying = self.in_flight()
        self._index(flying)  # communicators known only from calls in flight
        comms = []
        for index, comm_id in enumerate(self.comms.ids.tolist()):
            mine = flying[flying["comm_id"] == comm_id]
            oldest = mine[0] if len(mine) else None
            comms.append(
                CommPosition(
                    comm_id=comm_hex(comm_id),
                    comm_rank=int(self.comm_rank[index]),
                    comm_size=int(self.comm_size[index]),
                    last_entered=self.seq_or_none(self.last_entered, index),
                    last_completed=self.seq_or_none(self.last_completed, index),
                    in_flight=len(mine),
                    oldest_in_flight_s=None
                    if oldest is None
                    else (now_ns - self.waiting_since_ns(int(oldest["t_call_ns"]))) / 1e9,
                    oldest_in_flight_op=None if oldest is None else OP_NAMES.get(int(oldest["op"]), str(oldest["op"])),
                    oldest_in_flight_seq=None if oldest is None else int(oldest["seq"]),
                )
            )
        return RankPosition(
            global_rank=header.global_rank,
            local_rank=header.local_rank,
            pid=header.pid,
            ring=self.tail.name,
            alive=alive,
            stall=stall,
            last_call_ns=self.tail.last_call_ns,
            silent_s=round(self.silent_s(now_ns), 3),
            comms=sorted(comms, key=lambda c: c.comm_id),
        )
