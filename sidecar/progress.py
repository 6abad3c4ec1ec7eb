"""Where each local rank is: per communicator, the last collective entered and completed, and the calls
in flight with their ages. Updated from each poll's batch (vectorised per communicator)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rankwatch.analysis.ring import Op
from rankwatch.sidecar.protocol import OP_NAMES, CommPosition, RankPosition
from rankwatch.sidecar.ring_tail import RingTail, TailBatch

COLLECTIVE_MAX_OP = Op.SCATTER  # ops 1..8 are collectives: their seq is comparable across members


def comm_hex(comm_id: int) -> str:
    return f"{comm_id:016x}"


def is_collective(records: np.ndarray) -> np.ndarray:
    return (records["op"] >= Op.ALLREDUCE) & (records["op"] <= COLLECTIVE_MAX_OP)


def is_call(records: np.ndarray) -> np.ndarray:
    """NCCL communication calls (not communicator lifecycle records)."""
    return (records["op"] >= Op.ALLREDUCE) & (records["op"] <= Op.RECV)


@dataclass
class CommState:
    comm_rank: int
    comm_size: int
    last_entered: int | None = None
    last_completed: int | None = None


@dataclass
class RankProgress:
    """One ring's progress since the sidecar began reading it."""

    tail: RingTail
    comms: dict[int, CommState] = field(default_factory=dict)

    def update(self, batch: TailBatch) -> None:
        for records, attribute in ((batch.entered, "last_entered"), (batch.finished, "last_completed")):
            calls = records[is_call(records)]
            if not len(calls):
                continue
            comm_ids, first = np.unique(calls["comm_id"], return_index=True)
            collectives = is_collective(calls)
            for comm_id, at in zip(comm_ids.tolist(), first.tolist(), strict=True):
                state = self.comms.get(comm_id)
                if state is None:
                    state = self.comms[comm_id] = CommState(int(calls["rank"][at]), int(calls["nranks"][at]))
                seqs = calls["seq"][collectives & (calls["comm_id"] == comm_id)]
                if len(seqs):
                    top = int(seqs.max())
                    current = getattr(state, attribute)
                    setattr(state, attribute, top if current is None else max(current, top))

    def in_flight(self) -> np.ndarray:
        """Calls entered and not finished (host return, or GPU end when GPU-timed), oldest first."""
        pending = self.tail.pending
        return pending[np.argsort(pending["t_call_ns"], kind="stable")]

    def oldest_in_flight_age_s(self, now_ns: int) -> float | None:
        pending = self.tail.pending
        return (now_ns - int(pending["t_call_ns"].min())) / 1e9 if len(pending) else None

    def silent_s(self, now_ns: int) -> float:
        return max(0.0, (now_ns - self.tail.last_activity_ns) / 1e9)

    def position(self, now_ns: int, alive: bool, stall: str | None) -> RankPosition:
        header = self.tail.header
        flying = self.in_flight()
        comms = []
        for comm_id in sorted(set(self.comms) | set(flying["comm_id"].tolist())):
            state = self.comms.get(comm_id) or CommState(-1, -1)
            mine = flying[flying["comm_id"] == comm_id]
            oldest = mine[0] if len(mine) else None
            comms.append(
                CommPosition(
                    comm_id=comm_hex(comm_id),
                    comm_rank=state.comm_rank if oldest is None or state.comm_rank >= 0 else int(oldest["rank"]),
                    comm_size=state.comm_size if oldest is None or state.comm_size >= 0 else int(oldest["nranks"]),
                    last_entered=state.last_entered,
                    last_completed=state.last_completed,
                    in_flight=len(mine),
                    oldest_in_flight_s=None if oldest is None else (now_ns - int(oldest["t_call_ns"])) / 1e9,
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
            comms=comms,
        )
