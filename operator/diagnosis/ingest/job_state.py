"""What the operator knows of each running job from its sidecars: in memory, rebuilt from what they send.

Nothing here is persisted: after an operator restart the next window summaries (every few seconds,
from every pod) rebuild progress, waits and step times, and what is "in flight too long" is carried
by the summaries themselves (``oldest_in_flight_s``), so a hang that began before the restart is
still seen. Per job the cost is one small record per (rank, communicator) and a short window
history: a 16k-rank job is tens of thousands of small objects, not a trace.

Each history keeps what its reader uses and no more: a rank's waits on a communicator for the
detector's score (:data:`WAIT_HISTORY`), its record counts for sizing a dump (:data:`RECORDS_HISTORY`),
its scheduling figures for a cause (:data:`HOST_WINDOWS`), and the (pod, window) keys that tell a
redelivery (:data:`DEDUPE_WINDOWS` per pod). The per-rank and per-communicator histories are rings: a
list of fixed length made with the state, its slots overwritten in place, every reader indifferent to
their order (it filters by age or takes a maximum). So a job's state is as large after its first
window as it will ever be (``tests/unit/test_job_state_retention``), and a summary folded into it makes
no new container objects: a deque costs ~600 bytes even when empty, and a tuple replaced per window
would be a young object that lives, thousands per summary, that the garbage collector's young
generation keeps walking without counting (its threshold counts allocations net of deallocations).

Every per-job and per-rank structure is bounded (:class:`StateLimits`, derived from the job's spec by
the collector): what does not fit is dropped and counted in ``rankwatch_collector_dropped_total``, so a
sidecar (or whoever holds a job's token) cannot grow the operator's memory without limit.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rankwatch.analysis.cause import HostLoads, RankHostLoad
from rankwatch.protocol import CommWindow, StallReport, WindowSummary

WAIT_HISTORY = 3
"""Windows of wait p50s kept per (rank, communicator): the detector scores a rank on the median of its
last three (until 2026-11-29 twelve were kept, nine never read: a third of the operator's memory at
64,000 ranks)."""
NEVER = float("-inf")
"""The time of a ring slot not written yet: older than any age a reader asks for."""
RECORDS_HISTORY = 12
"""Windows of record counts kept per rank: a dump is sized on the busiest window of the last minute."""
STEP_HISTORY = 240
"""Job step-time points kept (one per pod summary): the baseline for "step time up"."""
DEDUPE_WINDOWS = 4
"""(pod, window) keys remembered per pod of the job's limits: a sidecar sends its windows in order and
resends one only while its answer is missing, so a redelivery is of one of its newest windows; an
older one is refused as replayed anyway (until 2026-11-29: 20,000 keys per job whatever its size,
~300 bytes each, filled after 10 minutes at 160 pods a job)."""
STALL_REPORTS_KEPT = 64
HOST_WINDOWS = 6
"""Windows of scheduling figures a cause is decided on (the straggler's recent past, not its whole life)."""
ENDED_PODS_KEPT = 65_536
"""Names of earlier attempts' pods remembered (to ignore what their sidecars still send)."""


@dataclass(frozen=True)
class StateLimits:
    """How much one job's state may hold; the collector derives it from the job's spec."""

    ranks: int = 131_072
    """Distinct global ranks (the job's world size)."""
    pods: int = 16_384
    """Distinct pods (replicas, spares and replacements)."""
    comms_per_rank: int = 64
    """Communicators followed per rank (a 3D-parallel rank has a handful)."""

    @classmethod
    def for_job(cls, world_size: int, replicas: int) -> StateLimits:
        # Pods: replacements within an attempt keep their replica's name, spares and stragglers of
        # the ending attempt may overlap: twice the replicas leaves room for both.
        return cls(ranks=max(1, world_size), pods=2 * max(1, replicas) + 8)


def _not_counted(what: str, count: int = 1) -> None:
    pass


def collective_wait(comm: CommWindow) -> float | None:
    """The p50 time a rank spent inside its collectives in a window: on the GPU when the ring has GPU
    times (the host call of an asynchronous GPU returns at once, so its host wait is ~0 for every
    rank; the GPU's start-to-end is where a straggler's peers wait for it), else on the host."""
    if comm.gpu is not None:
        return comm.gpu.p50
    return comm.wait.p50 if comm.wait is not None else None


def _as_tuple(digest: tuple) -> tuple:
    """Pickled as ``tuple.__new__(cls, values)``, rebuilt in C: a namedtuple's own ``__new__`` is Python."""
    return tuple.__new__, (type(digest), tuple(digest))


CommDigest = tuple[str, int, int | None, int | None, int, float | None, int, float | None]
"""What the job state keeps of one rank's window on one communicator: (comm_id, comm_size, last_entered,
last_completed, in_flight, oldest_in_flight_s, collectives: collective calls entered in the window (sends
and receives left out), wait_p50: collective_wait, None when the window had no collective with a measured
wait). A plain tuple, not a namedtuple: ~40 of them per summary come back from the parsing worker, and
unpickling a class instance (even rebuilt in C) cost the collector's event loop ~60 us per summary,
plain tuples ~8 us."""

RankDigest = tuple[int, bool, int, float | None, tuple[float, int] | None, tuple[CommDigest, ...]]
"""One rank's window: (global_rank, alive, records, step_time_s, scheduling: (run-queue delay seconds,
involuntary switches) or None, comms). A plain tuple, as :data:`CommDigest`."""


class SummaryDigest(NamedTuple):
    """The part of a :class:`WindowSummary` the collector checks and the job state keeps: made where the
    summary is parsed (a worker process), small and cheap to send back (tuples pickle ~40x faster than the
    summary's dataclasses)."""

    namespace: str
    job: str
    pod: str
    node: str
    replica_index: int
    window: int
    start_ns: int
    end_ns: int
    dropped_summaries: int
    cpu_pressure: float | None
    ranks: tuple[RankDigest, ...]

    __reduce__ = _as_tuple

    @classmethod
    def of(cls, summary: WindowSummary) -> SummaryDigest:
        return cls(
            summary.namespace,
            summary.job,
            summary.pod,
            summary.node,
            summary.replica_index,
            summary.window,
            summary.start_ns,
            summary.end_ns,
            summary.dropped_summaries,
            summary.cpu_pressure,
            tuple(
                (
                    window.global_rank,
                    window.alive,
                    window.records,
                    window.step_time_s,
                    None
                    if window.scheduling is None
                    else (window.scheduling.run_delay_s, window.scheduling.involuntary_switches),
                    tuple(_comm_digest(comm) for comm in window.comms),
                )
                for window in summary.ranks
            ),
        )


def _comm_digest(comm: CommWindow) -> CommDigest:
    collectives = sum(n for op, n in comm.calls.items() if op not in ("Send", "Recv"))
    return (
        comm.comm_id,
        comm.comm_size,
        comm.last_entered,
        comm.last_completed,
        comm.in_flight,
        comm.oldest_in_flight_s,
        collectives,
        collective_wait(comm) if collectives else None,
    )


@dataclass(slots=True)
class CommState:
    """One rank's progress and waits on one communicator."""

    comm_size: int
    last_entered: int | None = None
    last_completed: int | None = None
    advanced_at: float = 0.0  # operator monotonic time the completed sequence number last grew
    in_flight: int = 0
    oldest_in_flight_s: float | None = None  # as of ``seen_at``
    seen_at: float = 0.0
    waits: list[float] = field(default_factory=lambda: [NEVER, 0.0] * WAIT_HISTORY)
    """A ring of (received at, wait p50 in seconds (GPU when timed)) of the last ``WAIT_HISTORY`` windows
    with collectives, flattened ``[received_0, p50_0, received_1, p50_1, ...]``, in no order; a slot
    never written is received at ``NEVER``."""
    waits_taken: int = 0


@dataclass(slots=True)
class RankState:
    rank: int
    pod: str
    node: str
    alive: bool = True
    seen_at: float = 0.0
    records: list[int] = field(default_factory=lambda: [0] * RECORDS_HISTORY)
    """A ring of the records its trace ring took in each of the last ``RECORDS_HISTORY`` windows, in no order."""
    step_time_s: float | None = None
    wait_s: float | None = None
    """Median over its communicators of the p50 wait in its last window with collectives (for /metrics)."""
    comms: dict[str, CommState] = field(default_factory=dict)
    scheduling: list[float] = field(default_factory=lambda: [NEVER, 0.0, 0.0, 0] * HOST_WINDOWS)
    """A ring of (received at, window seconds, run-queue delay seconds, involuntary switches) of its
    last ``HOST_WINDOWS`` windows, flattened, in no order (a window without them leaves its slot as was)."""
    windows: int = 0
    """Windows taken from it: the slot of the next in its rings."""


@dataclass(slots=True)
class PodState:
    name: str
    node: str
    replica_index: int
    seen_at: float = 0.0
    ranks: set[int] = field(default_factory=set)
    cpu_pressure: list[float] = field(default_factory=lambda: [NEVER, 0.0] * HOST_WINDOWS)
    """A ring of (received at, the node's CPU pressure share) of the last ``HOST_WINDOWS`` summaries that
    had it, flattened, in no order."""
    pressures_taken: int = 0
    latest_start_ns: int = 0
    """Start of the newest window taken from this pod: an older one not seen before is a replay."""


@dataclass
class JobState:
    """Everything the detector reads for one job. Times are ``time.monotonic()`` of the operator."""

    namespace: str
    name: str
    first_seen: float = 0.0
    last_seen: float = 0.0
    progress_at: float = 0.0  # last time any communicator of any rank completed a collective
    ranks: dict[int, RankState] = field(default_factory=dict)
    pods: dict[str, PodState] = field(default_factory=dict)
    stalls: deque[tuple[float, StallReport]] = field(default_factory=lambda: deque(maxlen=STALL_REPORTS_KEPT))
    step_times: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=STEP_HISTORY))
    """(received at, median step time of the pod's ranks) per summary that had one."""
    summaries: int = 0
    dropped_summaries: int = 0
    ended_pods: frozenset[str] = frozenset()
    """Pods of earlier attempts: what their sidecars still send while they end is not this attempt's."""
    limits: StateLimits = field(default_factory=StateLimits)
    dropped: int = 0
    """Ranks, pods and communicators not kept because the job's limits were reached."""
    _seen: OrderedDict[tuple[str, int, int], None] = field(default_factory=OrderedDict, repr=False)
    on_drop: Callable[[str, int], None] = field(default=_not_counted, repr=False, compare=False)
    """Told of what is not kept (``DiagnosisMetrics.dropped``: rankwatch_collector_dropped_total)."""
    derived: dict[Hashable, Any] = field(default_factory=dict, repr=False, compare=False)
    """What readers (the detector) derive from who reports on which communicator, keyed by how they
    derived it: emptied whenever a rank or a rank's communicator is added or replaced."""

    def duplicate(self, key: tuple[str, int, int]) -> bool:
        """True if this (pod, start_ns, window) was taken among the job's last ``DEDUPE_WINDOWS`` windows
        per pod (of its limits); remembers it otherwise."""
        if key in self._seen:
            return True
        self._seen[key] = None
        if len(self._seen) > DEDUPE_WINDOWS * self.limits.pods:
            self._seen.popitem(last=False)
        return False

    def replayed(self, summary: WindowSummary | SummaryDigest) -> int | None:
        """The start of the pod's newest window when ``summary`` began before it (replayed, or sent out
        of order), else None. Exact redeliveries are told by :meth:`duplicate` first."""
        pod = self.pods.get(summary.pod)
        if pod is not None and summary.start_ns < pod.latest_start_ns:
            return pod.latest_start_ns
        return None

    def add_summary(self, summary: WindowSummary, now: float | None = None) -> None:
        self.add_digest(SummaryDigest.of(summary), now)

    def add_digest(self, summary: SummaryDigest, now: float | None = None) -> None:
        """Fold one window summary (as digested where it was parsed) into the job's state."""
        if summary.pod in self.ended_pods:
            return
        now = time.monotonic() if now is None else now
        if not self.first_seen:
            self.first_seen = self.progress_at = now
        self.last_seen = now
        self.summaries += 1
        self.dropped_summaries += summary.dropped_summaries
        pod = self._pod(summary.pod, summary.node, summary.replica_index)
        if pod is None:
            return
        pod.seen_at, pod.node = now, summary.node or pod.node
        if summary.cpu_pressure is not None:
            slot = pod.pressures_taken % HOST_WINDOWS * 2
            pod.cpu_pressure[slot], pod.cpu_pressure[slot + 1] = now, summary.cpu_pressure
            pod.pressures_taken += 1
        window_s = max(0.0, (summary.end_ns - summary.start_ns) / 1e9)
        pod.latest_start_ns = max(pod.latest_start_ns, summary.start_ns)
        steps = []
        progressed = False
        for global_rank, alive, records, step_time_s, scheduling, comms in summary.ranks:
            if global_rank < 0:
                continue  # a ring without RANK cannot be placed in the job
            rank = self.ranks.get(global_rank)
            if rank is None or rank.pod != summary.pod:
                if not self._room_for_rank(global_rank):
                    continue
                rank = self.ranks[global_rank] = RankState(global_rank, summary.pod, summary.node)
                self.derived.clear()
            pod.ranks.add(global_rank)
            rank.alive, rank.seen_at = alive, now
            rank.records[rank.windows % RECORDS_HISTORY] = records
            if scheduling is not None and window_s > 0:
                slot = rank.windows % HOST_WINDOWS * 4
                rank.scheduling[slot : slot + 4] = now, window_s, *scheduling
            rank.windows += 1
            if step_time_s:
                rank.step_time_s = step_time_s
                steps.append(step_time_s)
            waits = []
            states = rank.comms
            for comm_id, size, last_entered, last_completed, in_flight, oldest, _collectives, wait in comms:
                state = states.get(comm_id)
                if state is None:
                    if len(states) >= self.limits.comms_per_rank:
                        self._drop("comm")
                        continue
                    state = states[comm_id] = CommState(size, advanced_at=now)
                    self.derived.clear()
                completed, entered = state.last_completed, state.last_entered
                if last_completed is not None and (completed is None or last_completed > completed):
                    state.last_completed, state.advanced_at = last_completed, now
                    progressed = True
                if last_entered is not None and (entered is None or last_entered > entered):
                    state.last_entered = last_entered
                state.in_flight, state.oldest_in_flight_s, state.seen_at = in_flight, oldest, now
                if wait is not None:
                    slot = state.waits_taken % WAIT_HISTORY * 2
                    state.waits[slot], state.waits[slot + 1] = now, wait
                    state.waits_taken += 1
                    waits.append(wait)
            if waits:
                waits.sort()
                middle = len(waits) // 2
                rank.wait_s = waits[middle] if len(waits) % 2 else (waits[middle - 1] + waits[middle]) / 2
        if progressed:
            self.progress_at = now
        if steps:
            steps.sort()
            self.step_times.append((now, steps[len(steps) // 2]))

    def add_stall(self, report: StallReport, now: float | None = None) -> None:
        if report.pod in self.ended_pods:
            return
        now = time.monotonic() if now is None else now
        if not self.first_seen:
            self.first_seen = self.progress_at = now
        self.last_seen = now
        pod = self._pod(report.pod, report.node, report.replica_index)
        if pod is None:
            return
        for position in report.positions:
            if position.global_rank >= 0 and position.global_rank not in self.ranks:
                if not self._room_for_rank(position.global_rank):
                    continue
                self.ranks[position.global_rank] = RankState(position.global_rank, report.pod, report.node)
                self.derived.clear()
                pod.ranks.add(position.global_rank)
        self.stalls.append((now, report))

    def host_loads(self, now: float, max_age_s: float) -> HostLoads:
        """Each rank's run-queue delay per second and the CPU pressure per node over the summaries of the
        last ``max_age_s`` seconds (at most ``HOST_WINDOWS`` windows); ranks and nodes without figures
        are left out."""
        ranks = {}
        for rank in self.ranks.values():
            ring = rank.scheduling
            times = ring[::4]
            if now - max(times) > max_age_s:
                continue  # no recent window had figures (none from this sidecar): the detector's common case
            if now - min(times) <= max_age_s:  # every slot recent: summed in C, in the same order
                windows, seconds, delay, switches = len(times), sum(ring[1::4]), sum(ring[2::4]), sum(ring[3::4])
            else:
                recent = [ring[slot : slot + 4] for slot in range(0, len(ring), 4) if now - ring[slot] <= max_age_s]
                windows, seconds = len(recent), sum(entry[1] for entry in recent)
                delay, switches = sum(entry[2] for entry in recent), sum(entry[3] for entry in recent)
            if seconds > 0:
                node = self.node_of_pod(rank.pod) or rank.node
                ranks[rank.rank] = RankHostLoad(
                    rank.rank, node, round(delay / seconds, 6), round(switches / seconds, 3), windows
                )
        per_node: dict[str, list[float]] = {}
        for pod in self.pods.values():
            ring = pod.cpu_pressure
            values = [ring[slot + 1] for slot in range(0, len(ring), 2) if now - ring[slot] <= max_age_s]
            if values and pod.node:
                per_node.setdefault(pod.node, []).append(sum(values) / len(values))
        return HostLoads(ranks, {node: round(max(values), 4) for node, values in per_node.items()})

    def _pod(self, name: str, node: str, replica_index: int) -> PodState | None:
        pod = self.pods.get(name)
        if pod is None:
            if len(self.pods) >= self.limits.pods:
                self._drop("pod")
                return None
            pod = self.pods[name] = PodState(name, node, replica_index)
        return pod

    def _room_for_rank(self, rank: int) -> bool:
        """A rank id within the world size, and (for a new one) room in the job's ranks."""
        if rank >= self.limits.ranks or (rank not in self.ranks and len(self.ranks) >= self.limits.ranks):
            self._drop("rank")
            return False
        return True

    def _drop(self, what: str) -> None:
        self.dropped += 1
        self.on_drop(what, 1)

    def recent_step_time(self) -> float | None:
        """Median of the last 8 step-time points (one per pod summary), None before the first."""
        recent = sorted(value for _, value in list(self.step_times)[-8:])
        return recent[len(recent) // 2] if recent else None

    def node_of_pod(self, pod: str) -> str:
        state = self.pods.get(pod)
        return state.node if state else ""


class JobStore:
    """The per-job states, keyed by (namespace, name)."""

    def __init__(self, on_drop: Callable[[str, int], None] = _not_counted) -> None:
        self.jobs: dict[tuple[str, str], JobState] = {}
        self.on_drop = on_drop

    def get(self, namespace: str, name: str, limits: StateLimits | None = None) -> JobState:
        """The job's state, made on first use; ``limits`` (when given) replace the job's current ones
        (the spec may have been scaled)."""
        key = (namespace, name)
        state = self.jobs.get(key)
        if state is None:
            state = self.jobs[key] = JobState(namespace, name, limits=limits or StateLimits(), on_drop=self.on_drop)
        elif limits is not None and limits != state.limits:
            state.limits = limits
        return state

    def peek(self, namespace: str, name: str) -> JobState | None:
        return self.jobs.get((namespace, name))

    def drop(self, namespace: str, name: str) -> None:
        self.jobs.pop((namespace, name), None)

    def new_attempt(self, namespace: str, name: str, ended_pods: set[str]) -> None:
        """Start the job's state afresh for its next attempt, ignoring the ended attempt's pods."""
        old = self.jobs.get((namespace, name))
        ended = frozenset(ended_pods) | (old.ended_pods if old else frozenset())
        if len(ended) > ENDED_PODS_KEPT:  # the newest attempts' pods matter; older ones have ended long ago
            self.on_drop("ended_pod", len(ended) - ENDED_PODS_KEPT)
            ended = frozenset(sorted(ended_pods)[:ENDED_PODS_KEPT])
        limits = old.limits if old else StateLimits()
        self.jobs[(namespace, name)] = JobState(namespace, name, ended_pods=ended, limits=limits, on_drop=self.on_drop)
