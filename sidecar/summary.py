"""Window summaries: what each local rank did on each communicator during one window.

The builder keeps the arrays each poll returned and reduces them once, at the window's end, with
numpy per communicator (a rank has a handful): no per-record Python. Calls are counted when first
seen (entered), durations when they finish; a call in flight at the end of a window is counted in
``in_flight`` and its duration lands in the window where it finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rankwatch.analysis.ring import RECORD_DTYPE, State
from rankwatch.sidecar.progress import RankProgress, comm_hex, is_call, is_collective
from rankwatch.sidecar.protocol import (
    OP_NAMES,
    SCHEMA_VERSION,
    CommWindow,
    Quantiles,
    RankWindow,
    WindowSummary,
)
from rankwatch.sidecar.ring_tail import PolledRing

MIN_REPEATS_FOR_STEP = 3


@dataclass(frozen=True)
class PodIdentity:
    """Who is speaking: the job and the pod, as every message states them."""

    namespace: str
    job: str
    pod: str
    node: str
    replica_index: int
    expected_ranks: int = 0


def quantiles(durations_ns: np.ndarray) -> Quantiles | None:
    if not len(durations_ns):
        return None
    seconds = durations_ns.astype(np.float64) / 1e9
    p50, p90, p99 = np.quantile(seconds, (0.5, 0.9, 0.99)).tolist()
    return Quantiles(len(seconds), round(p50, 9), round(p90, 9), round(p99, 9), round(float(seconds.max()), 9))


def step_time_s(collectives: np.ndarray) -> float | None:
    """The longest typical period among call signatures (communicator, op, count) repeated at least
    three times: the loss or gradient AllReduce recurs once per training step."""
    if len(collectives) < MIN_REPEATS_FOR_STEP:
        return None
    keys = np.stack([collectives["comm_id"], collectives["op"].astype(np.uint64), collectives["count"]], axis=1)
    _, group, repeats = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    group = group.ravel()
    order = np.lexsort((collectives["t_call_ns"], group))
    gaps = np.diff(collectives["t_call_ns"][order])
    same = group[order][1:] == group[order][:-1]
    best = None
    for candidate in np.flatnonzero(repeats >= MIN_REPEATS_FOR_STEP).tolist():
        typical = float(np.median(gaps[same & (group[order][1:] == candidate)]))
        best = typical if best is None else max(best, typical)
    return None if best is None else round(best / 1e9, 9)


@dataclass
class _RingWindow:
    progress: RankProgress
    alive: bool = True
    entered: list[np.ndarray] = field(default_factory=list)
    finished: list[np.ndarray] = field(default_factory=list)
    torn: int = 0
    overwritten: int = 0


class WindowBuilder:
    """Accumulates polls; ``close()`` returns the summary of the window and starts the next one."""

    def __init__(self, identity: PodIdentity, start_ns: int) -> None:
        self.identity = identity
        self.window = 0
        self.start_ns = start_ns
        self._rings: dict[str, _RingWindow] = {}
        self._ended: set[str] = set()
        self._last_call: dict[tuple[str, int], int] = {}  # (ring, comm) -> t_call of the rank's previous call

    def add(self, ring: PolledRing, progress: RankProgress) -> None:
        part = self._rings.get(ring.tail.name)
        if part is None or part.progress is not progress:
            part = self._rings[ring.tail.name] = _RingWindow(progress)
        part.alive = ring.alive
        if len(ring.batch.entered):
            part.entered.append(ring.batch.entered)
        if len(ring.batch.finished):
            part.finished.append(ring.batch.finished)
        part.torn += ring.batch.torn
        part.overwritten += ring.batch.overwritten
        if ring.ended:
            self._ended.add(ring.tail.name)

    def close(self, end_ns: int, dropped_summaries: int = 0) -> WindowSummary:
        self.window += 1
        ranks = [self._rank_window(name, part, end_ns) for name, part in sorted(self._rings.items())]
        summary = WindowSummary(
            schema=SCHEMA_VERSION,
            namespace=self.identity.namespace,
            job=self.identity.job,
            pod=self.identity.pod,
            node=self.identity.node,
            replica_index=self.identity.replica_index,
            expected_ranks=self.identity.expected_ranks,
            window=self.window,
            start_ns=self.start_ns,
            end_ns=end_ns,
            dropped_summaries=dropped_summaries,
            ranks=sorted(ranks, key=lambda r: (r.global_rank, r.ring)),
        )
        for name in self._ended:
            del self._rings[name]
            self._last_call = {key: value for key, value in self._last_call.items() if key[0] != name}
        self._ended.clear()
        for part in self._rings.values():
            part.entered, part.finished, part.torn, part.overwritten = [], [], 0, 0
        self.start_ns = end_ns
        return summary

    def _rank_window(self, name: str, part: _RingWindow, end_ns: int) -> RankWindow:
        tail = part.progress.tail
        entered = np.concatenate(part.entered) if part.entered else np.empty(0, RECORD_DTYPE)
        finished = np.concatenate(part.finished) if part.finished else np.empty(0, RECORD_DTYPE)
        entered_calls, finished_calls = entered[is_call(entered)], finished[is_call(finished)]
        pending = tail.pending[is_call(tail.pending)]
        comm_ids = np.unique(np.concatenate([entered_calls["comm_id"], finished_calls["comm_id"], pending["comm_id"]]))
        comms = [
            self._comm_window(name, int(comm_id), part.progress, entered_calls, finished_calls, pending, end_ns)
            for comm_id in comm_ids.tolist()
        ]
        header = tail.header
        return RankWindow(
            global_rank=header.global_rank,
            local_rank=header.local_rank,
            pid=header.pid,
            ring=name,
            alive=part.alive,
            records=len(entered),
            torn=part.torn,
            overwritten=part.overwritten,
            lost_updates=header.lost_updates,
            last_call_ns=tail.last_call_ns,
            step_time_s=step_time_s(entered_calls[is_collective(entered_calls)]),
            comms=comms,
        )

    def _comm_window(
        self,
        ring: str,
        comm_id: int,
        progress: RankProgress,
        entered: np.ndarray,
        finished: np.ndarray,
        pending: np.ndarray,
        end_ns: int,
    ) -> CommWindow:
        entered = entered[entered["comm_id"] == comm_id]
        finished = finished[finished["comm_id"] == comm_id]
        pending = pending[pending["comm_id"] == comm_id]
        entered_seq = entered["seq"][is_collective(entered)]
        finished_seq = finished["seq"][is_collective(finished)]
        by_op = np.bincount(entered["op"], minlength=len(OP_NAMES) + 1)
        returned = finished[(finished["t_return_ns"] > 0) & (finished["state"] != State.FAILED)]
        timed = finished[(finished["gpu_start_ns"] > 0) & (finished["gpu_end_ns"] >= finished["gpu_start_ns"])]

        call_times = np.sort(entered["t_call_ns"])
        previous = self._last_call.get((ring, comm_id))
        if len(call_times):
            self._last_call[(ring, comm_id)] = int(call_times[-1])
            if previous is not None:
                call_times = np.concatenate(([previous], call_times))

        state = progress.comms.get(comm_id)
        sample = next((records[0] for records in (entered, finished, pending) if len(records)), None)
        return CommWindow(
            comm_id=comm_hex(comm_id),
            comm_rank=state.comm_rank if state else int(sample["rank"]),
            comm_size=state.comm_size if state else int(sample["nranks"]),
            first_entered=int(entered_seq.min()) if len(entered_seq) else None,
            last_entered=int(entered_seq.max()) if len(entered_seq) else None,
            first_completed=int(finished_seq.min()) if len(finished_seq) else None,
            last_completed=int(finished_seq.max()) if len(finished_seq) else None,
            in_flight=len(pending),
            oldest_in_flight_s=round((end_ns - int(pending["t_call_ns"].min())) / 1e9, 6) if len(pending) else None,
            calls={OP_NAMES[op]: int(n) for op, n in enumerate(by_op.tolist()) if n and op in OP_NAMES},
            failed=int((finished["state"] == State.FAILED).sum()),
            wait=quantiles(returned["t_return_ns"] - returned["t_call_ns"]),
            gap=quantiles(np.diff(call_times)),
            gpu=quantiles(timed["gpu_end_ns"] - timed["gpu_start_ns"]),
        )
