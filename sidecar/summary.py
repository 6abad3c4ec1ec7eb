"""Window summaries: what each local rank did on each communicator during one window.

The builder keeps each poll's calls as flat columns and reduces them once, at the window's end: one
stable sort by communicator, then slices (a rank has a handful of communicators); no per-record
Python. Calls are counted when first seen (entered), durations when they finish; a call in flight
at the end of a window is counted in ``in_flight`` and its duration lands in the window where it
finishes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

import numpy as np

from rankwatch.protocol import OP_NAMES, SCHEMA_VERSION, CommWindow, Quantiles, RankWindow, WindowSummary
from rankwatch.sidecar.host_load import HostSampler
from rankwatch.sidecar.progress import Entered, Finished, RankProgress, comm_hex, is_call, is_collective
from rankwatch.sidecar.ring_tail import PolledRing

MIN_REPEATS_FOR_STEP = 3
COUNT_BITS = 48  # element counts beyond 2**48 share a step signature with smaller ones: harmless


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
    p50, p90, p99 = (np.quantile(durations_ns, (0.5, 0.9, 0.99)) / 1e9).tolist()
    return Quantiles(len(durations_ns), round(p50, 9), round(p90, 9), round(p99, 9), int(durations_ns.max()) / 1e9)


def step_time_s(entered: Entered) -> float | None:
    """The longest typical period among call signatures (communicator, op, count) repeated at least
    three times: the loss or gradient AllReduce recurs once per training step."""
    collective = is_collective(entered.op)
    if collective.sum() < MIN_REPEATS_FOR_STEP:
        return None
    signature = (
        (entered.comm[collective].astype(np.uint64) << np.uint64(56))
        | (entered.op[collective].astype(np.uint64) << np.uint64(COUNT_BITS))
        | (entered.count[collective] & np.uint64((1 << COUNT_BITS) - 1))
    )
    _, group, repeats = np.unique(signature, return_inverse=True, return_counts=True)
    order = np.argsort(group, kind="stable")  # calls arrive in claim order: time order within a group
    gaps = np.diff(entered.t_call[collective][order])
    bounds = np.searchsorted(group[order], np.arange(len(repeats) + 1))
    best = None
    for candidate in np.flatnonzero(repeats >= MIN_REPEATS_FOR_STEP).tolist():
        typical = float(np.median(gaps[bounds[candidate] : bounds[candidate + 1] - 1]))
        best = typical if best is None else max(best, typical)
    return None if best is None else round(best / 1e9, 9)


def _concatenate(parts: list, kind: type) -> object:
    if len(parts) == 1:
        return parts[0]
    return kind(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(kind)))


def _by_comm(comm: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """A stable order grouping rows by communicator index, and each group's [start, end) bounds."""
    order = np.argsort(comm, kind="stable")
    bounds = np.searchsorted(comm[order], np.arange(count + 1))
    return order, bounds


@dataclass
class _RingWindow:
    progress: RankProgress
    alive: bool = True
    records: int = 0
    entered: list[Entered] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    torn: int = 0
    overwritten: int = 0


class WindowBuilder:
    """Accumulates polls; ``close()`` returns the summary of the window and starts the next one. With a
    ``host`` sampler, each summary carries the ranks' scheduling and the node's CPU pressure."""

    def __init__(self, identity: PodIdentity, start_ns: int, host: HostSampler | None = None) -> None:
        self.identity = identity
        self.host = host
        self.window = 0
        self.start_ns = start_ns
        self._rings: dict[str, _RingWindow] = {}
        self._ended: set[str] = set()
        self._last_call: dict[str, np.ndarray] = {}  # ring -> t_call of the previous call, per communicator

    def add(self, ring: PolledRing, progress: RankProgress, entered: Entered, finished: Finished) -> None:
        part = self._rings.get(ring.tail.name)
        if part is None or part.progress is not progress:
            part = self._rings[ring.tail.name] = _RingWindow(progress)
        part.alive = ring.alive
        part.records += len(ring.batch.entered)
        if len(entered.op):
            part.entered.append(entered)
        if len(finished.op):
            part.finished.append(finished)
        part.torn += ring.batch.torn
        part.overwritten += ring.batch.overwritten
        if ring.ended:
            self._ended.add(ring.tail.name)

    def close(self, end_ns: int, dropped_summaries: int = 0) -> WindowSummary:
        self.window += 1
        ranks = [self._rank_window(name, part, end_ns) for name, part in sorted(self._rings.items())]
        if self.host is not None:
            self.host.forget_except({part.progress.tail.header.pid for part in self._rings.values()})
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
            cpu_pressure=self.host.cpu_pressure(time.monotonic_ns()) if self.host is not None else None,
        )
        for name in self._ended:
            del self._rings[name]
            self._last_call.pop(name, None)
        self._ended.clear()
        for part in self._rings.values():
            part.entered, part.finished, part.records, part.torn, part.overwritten = [], [], 0, 0, 0
        self.start_ns = end_ns
        return summary

    def _rank_window(self, name: str, part: _RingWindow, end_ns: int) -> RankWindow:
        progress = part.progress
        tail = progress.tail
        empty_e = Entered(*(np.empty(0, dtype) for dtype in (np.int64, np.uint8, np.uint64, np.uint64, np.int64)))
        empty_f = Finished(*(np.empty(0, dtype) for dtype in (np.int64, np.uint8, np.uint64, np.int64, np.int64, bool)))
        entered = _concatenate(part.entered, Entered) if part.entered else empty_e
        finished = _concatenate(part.finished, Finished) if part.finished else empty_f
        pending = tail.pending[is_call(tail.pending["op"])]
        pending_comm = progress.comms.index(pending["comm_id"]) if len(pending) else np.empty(0, np.int64)
        count = len(progress.comms)  # calls in flight may name a communicator not seen finished yet

        order_e, bounds_e = _by_comm(entered.comm, count)
        order_f, bounds_f = _by_comm(finished.comm, count)
        last_call = self._last_call.setdefault(name, np.zeros(0, np.int64))
        if len(last_call) < count:
            last_call = self._last_call[name] = np.concatenate([last_call, np.zeros(count - len(last_call), np.int64)])

        comms = []
        for index in range(count):
            e = order_e[bounds_e[index] : bounds_e[index + 1]]
            f = order_f[bounds_f[index] : bounds_f[index + 1]]
            in_flight = pending["t_call_ns"][pending_comm == index]
            if not (len(e) or len(f) or len(in_flight)):
                continue
            op, seq = entered.op[e], entered.seq[e]
            entered_seq = seq[is_collective(op)]
            finished_seq = finished.seq[f][is_collective(finished.op[f])]
            wait, gpu = finished.wait[f], finished.gpu[f]
            times = np.sort(entered.t_call[e])
            if len(times):
                previous = int(last_call[index])
                last_call[index] = times[-1]
                if previous:
                    times = np.concatenate(([previous], times))
            by_op = np.bincount(op, minlength=len(OP_NAMES))
            comms.append(
                CommWindow(
                    comm_id=comm_hex(int(progress.comms.ids[index])),
                    comm_rank=int(progress.comm_rank[index]),
                    comm_size=int(progress.comm_size[index]),
                    first_entered=int(entered_seq.min()) if len(entered_seq) else None,
                    last_entered=int(entered_seq.max()) if len(entered_seq) else None,
                    first_completed=int(finished_seq.min()) if len(finished_seq) else None,
                    last_completed=int(finished_seq.max()) if len(finished_seq) else None,
                    in_flight=len(in_flight),
                    oldest_in_flight_s=round((end_ns - progress.waiting_since_ns(int(in_flight.min()))) / 1e9, 6)
                    if len(in_flight)
                    else None,
                    calls={OP_NAMES[o]: int(n) for o, n in enumerate(by_op.tolist()) if n and o in OP_NAMES},
                    failed=int(finished.failed[f].sum()),
                    wait=quantiles(wait[wait >= 0]),
                    gap=quantiles(np.diff(times)),
                    gpu=quantiles(gpu[gpu >= 0]),
                )
            )
        header = tail.header
        scheduling = None
        if self.host is not None and part.alive:
            scheduling = self.host.rank(header.pid, header.start_realtime_ns)
        return RankWindow(
            global_rank=header.global_rank,
            local_rank=header.local_rank,
            pid=header.pid,
            ring=name,
            alive=part.alive,
            records=part.records,
            torn=part.torn,
            overwritten=part.overwritten,
            lost_updates=header.lost_updates,
            last_call_ns=tail.last_call_ns,
            step_time_s=step_time_s(entered),
            comms=sorted(comms, key=lambda c: c.comm_id),
            scheduling=scheduling,
        )
