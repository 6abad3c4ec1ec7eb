"""Cheap suspicion from window summaries: is the job stalled, slower than its own baseline, or is one
rank's wait out of line with its tensor-parallel peers?

This only decides whether to look closer; the diagnosis (raw dumps + ``rankwatch.analysis``) names
the culprit and decides what is written on the job. Pure functions of a ``JobState`` and the clock,
linear in ranks x communicators, so a timer can run them every window for thousands of ranks.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rankwatch.analysis.cause import starved
from rankwatch.analysis.topology import Layout
from rankwatch.model.finding import Finding, FindingKind
from rankwatch.operator.diagnosis.ingest.job_state import WAIT_HISTORY, CommState, JobState

WAIT_RATIO = 0.3
"""A rank whose wait is at most this fraction of its peers' median waits out of line..."""
WAIT_MARGIN_S = 100e-6
"""... and by at least this much: sub-100 µs differences are scheduling noise, not a slow GPU."""
STEP_RISE = 0.10
"""Step time up by at least 10% over the job's baseline..."""
STEP_SIGMAS = 4.0
"""... and by more than this many robust standard deviations of the baseline."""
HELD_BACK_RATIO = 3.0
"""A starved rank's group waits at least three times as long as the job's other groups of its kind."""
STEP_MIN_BASELINE = 6
STEP_CURRENT_WINDOWS = 3
EVIDENCE_WINDOWS = max(WAIT_HISTORY, STEP_CURRENT_WINDOWS) + 0.5
"""How far back the slowness checks (waits, host loads, step time) look, in windows: a job whose newest
summary is older than this gives them nothing to read."""


@dataclass(frozen=True)
class Thresholds:
    sensitivity_s: float
    window_s: float


def suspected(
    kind: FindingKind | str, ranks: list[int], summary: str, evidence: dict[str, Any] | None = None
) -> Finding:
    """Why the detector wants a diagnosis, in the model's one shape: the kind of finding it expects (hang,
    straggler, or fail-slow for a step time above the job's own baseline), the ranks it already
    suspects, what it saw. No nodes and confidence 0: only the diagnosis names nodes and is sure."""
    return Finding(kind, ranks, [], None, 0.0, summary, evidence or {})


def detect(state: JobState, thresholds: Thresholds, layout: Layout | None, now: float) -> list[Finding]:
    """Findings, strongest first (a hang makes slowness moot). The hang checks run on every job every
    time (a job that went silent may be hung); the slowness checks only while the job has summaries
    within their horizon: without, they would find nothing (the same answer, without walking every
    rank of every silent job each window)."""
    hang = stalled(state, thresholds, now)
    if hang:
        return [hang]
    if now - state.last_seen > EVIDENCE_WINDOWS * thresholds.window_s:
        return []
    found = []
    outliers = wait_outliers(state, layout, thresholds, now) or host_starved(state, layout, thresholds, now)
    if outliers:
        found.append(outliers)
    slowdown = step_time_up(state, thresholds, now)
    if slowdown:
        found.append(slowdown)
    return found


def stalled(state: JobState, thresholds: Thresholds, now: float) -> Finding | None:
    """A stall report not followed by progress, a call in flight longer than the sensitivity, or no
    communicator of the job advancing for the sensitivity while its sidecars keep reporting."""
    sensitivity = thresholds.sensitivity_s
    for received, report in reversed(state.stalls):
        if now - received > sensitivity * 2:
            break
        moved = [
            rank
            for rank in report.stalled_ranks
            if rank in state.ranks and any(c.advanced_at > received for c in state.ranks[rank].comms.values())
        ]
        if report.stalled_ranks and not moved:
            return suspected(
                "hang",
                sorted(report.stalled_ranks),
                f"sidecar of pod {report.pod} reported a stall: {report.summary}",
                {"source": "stall_report", "pod": report.pod, "node": report.node},
            )
    oldest: tuple[float, int, str] | None = None
    fresh = 3 * (thresholds.window_s + 5)
    for rank in state.ranks.values():
        if now - rank.seen_at > fresh:
            continue  # its sidecar stopped reporting (pod gone): not something a dump can explain
        for comm_id, comm in rank.comms.items():
            if comm.in_flight and comm.oldest_in_flight_s is not None:
                age = comm.oldest_in_flight_s + (now - comm.seen_at)
                if age >= sensitivity and (oldest is None or age > oldest[0]):
                    oldest = (age, rank.rank, comm_id)
    if oldest is not None:
        age, rank_id, comm_id = oldest
        return suspected(
            "hang",
            [],  # the oldest waiter is a victim more often than the culprit: the analysis decides
            f"rank {rank_id} has been inside a call on communicator {comm_id} for {age:.0f} s "
            f"(sensitivity {sensitivity:.0f} s)",
            {"source": "in_flight", "rank": rank_id, "communicator": comm_id, "seconds": round(age, 1)},
        )
    quiet = now - state.progress_at
    if (
        state.ranks
        and now - state.first_seen >= sensitivity
        and quiet >= sensitivity
        and now - state.last_seen < 3 * (thresholds.window_s + 5)
    ):
        return suspected(
            "hang",
            [],
            f"no communicator of the job completed a collective for {quiet:.0f} s (sensitivity {sensitivity:.0f} s)",
            {"source": "no_progress", "seconds": round(quiet, 1)},
        )
    return None


def _recent_wait(comm: CommState, since: float) -> float | None:
    """The median of the rank's last (at most ``WAIT_HISTORY``, all the state keeps) wait p50s received
    since ``since``, None with fewer than two (run for every rank and communicator of every job each
    window: kept cheap)."""
    waits = comm.waits
    if len(waits) == 6:  # WAIT_HISTORY 3, every window recent (the common case): no list made
        first_at, first, second_at, second, third_at, third = waits
        if first_at >= since and second_at >= since and third_at >= since:
            return max(min(first, second), min(max(first, second), third))
    recent = [waits[i + 1] for i in range(0, len(waits), 2) if waits[i] >= since]
    if len(recent) == 3:
        first, second, third = recent
        return max(min(first, second), min(max(first, second), third))  # the middle one, without a sort
    if len(recent) < 2:
        return None
    return statistics.median(recent)


def peer_groups(state: JobState, layout: Layout | None) -> dict[str, dict[int, CommState]]:
    """Communicator -> its members' states, restricted to the groups whose members do the same work:
    TP groups when the layout has tensor parallelism, else every communicator of 3 or more. Kept with the
    state until its ranks or communicators change (a third of the detector's time at 1,280 ranks)."""
    key = ("peer_groups", layout)
    groups = state.derived.get(key)
    if groups is None:
        groups = state.derived[key] = _peer_groups(state, layout)
    return groups


def _peer_groups(state: JobState, layout: Layout | None) -> dict[str, dict[int, CommState]]:
    groups: dict[str, dict[int, CommState]] = defaultdict(dict)
    for rank in state.ranks.values():
        for comm_id, comm in rank.comms.items():
            groups[comm_id][rank.rank] = comm
    chosen = {}
    for comm_id, members in groups.items():
        size = next(iter(members.values())).comm_size
        if size < 2 or len(members) < size:
            continue  # not every member reported yet: no fair comparison
        if layout is not None and layout.tp > 1:
            if max(members) >= layout.world_size or layout.group_kind(set(members)) != "TP":
                continue
        elif size < 3:
            continue
        chosen[comm_id] = members
    return chosen


def wait_outliers(state: JobState, layout: Layout | None, thresholds: Thresholds, now: float) -> Finding | None:
    """The ranks that wait far less than their peers (a straggler arrives last and waits least)."""
    since = now - (WAIT_HISTORY + 0.5) * thresholds.window_s
    flagged: dict[int, dict[str, Any]] = {}
    for comm_id, members in peer_groups(state, layout).items():
        waits = {rank: _recent_wait(comm, since) for rank, comm in members.items()}
        if any(value is None for value in waits.values()):
            continue
        values: dict[int, float] = waits  # type: ignore[assignment]
        ordered = sorted(values.values())
        # Leaving one member out moves the median by one place at most: no peers' median exceeds this,
        # so a rank waiting more than WAIT_RATIO of it is in line (most ranks of most groups: one sort
        # per group instead of one per member).
        highest_median = ordered[(len(ordered) - 1) // 2 + 1]
        for rank, value in values.items():
            if value > WAIT_RATIO * highest_median:
                continue
            others = [other for peer, other in values.items() if peer != rank]
            median = statistics.median(others)  # leave-one-out: the suspect does not shift its own yardstick
            # A straggler's peers wait for it in every collective, so its own wait is a small fraction of
            # theirs; jitter moves waits by tens of percent, not by a factor of three. (A z score over a
            # handful of peers is too easily extreme to decide on its own; it is kept as evidence.)
            margin = 2 * WAIT_MARGIN_S if len(values) == 2 else WAIT_MARGIN_S
            out_of_line = value <= WAIT_RATIO * median and median - value >= margin
            if out_of_line:
                mad = statistics.median(abs(other - median) for other in others)
                z = (value - median) / (1.4826 * mad + max(0.05 * median, 20e-6))
                flagged[rank] = {
                    "communicator": comm_id,
                    "wait_s": round(value, 6),
                    "peers_median_s": round(median, 6),
                    "z": round(z, 1),
                }
    return _straggler_suspicion(
        flagged,
        "wait_outlier",
        lambda first, info: (
            f"rank {first} waits {info['wait_s'] * 1e3:.2f} ms in communicator {info['communicator']} vs its "
            f"peers' median {info['peers_median_s'] * 1e3:.2f} ms over the last {WAIT_HISTORY} windows"
        ),
    )


def _straggler_suspicion(
    flagged: dict[int, dict[str, Any]], source: str, describe: Callable[[int, dict[str, Any]], str]
) -> Finding | None:
    """One straggler suspicion for the flagged ranks, described by the lowest of them."""
    if not flagged:
        return None
    first = min(flagged)
    return suspected(
        "straggler",
        sorted(flagged),
        describe(first, flagged[first]),
        {"source": source, "ranks": {str(rank): value for rank, value in sorted(flagged.items())}},
    )


def host_starved(state: JobState, layout: Layout | None, thresholds: Thresholds, now: float) -> Finding | None:
    """A rank whose process waits for a CPU far longer than the job's other ranks (the summaries'
    run-queue delays) while its peer group waits far longer in its collectives than the job's other
    groups of the same kind: its starved host holds the group back. Where the traces' waits cannot
    single it out (a rank whose collectives progress on its starved host is late inside them too),
    this is the evidence."""
    max_age = (WAIT_HISTORY + 0.5) * thresholds.window_s
    loads = state.host_loads(now, max_age)
    if len(loads.ranks) < 3:
        return None
    since = now - max_age
    groups = peer_groups(state, layout)
    group_wait: dict[str, float] = {}
    for comm_id, members in groups.items():
        waits = [_recent_wait(comm, since) for comm in members.values()]
        if all(wait is not None for wait in waits):
            group_wait[comm_id] = statistics.median(waits)  # type: ignore[type-var]
    flagged: dict[int, dict[str, Any]] = {}
    for rank, load in loads.ranks.items():
        peers = statistics.median(other.run_delay_share for r, other in loads.ranks.items() if r != rank)
        if not starved(load.run_delay_share, peers):
            continue
        for comm_id, members in groups.items():
            if rank not in members or comm_id not in group_wait:
                continue
            size = len(members)
            others = [wait for other, wait in group_wait.items() if other != comm_id and len(groups[other]) == size]
            if not others:
                continue
            typical = statistics.median(others)
            wait = group_wait[comm_id]
            if wait >= HELD_BACK_RATIO * typical and wait - typical >= WAIT_MARGIN_S:
                flagged[rank] = {
                    "communicator": comm_id,
                    "run_delay_ms_per_s": round(load.run_delay_share * 1e3, 1),
                    "peers_run_delay_ms_per_s": round(peers * 1e3, 1),
                    "group_wait_s": round(wait, 6),
                    "other_groups_wait_s": round(typical, 6),
                    "other_groups": len(others),
                }
                break
    return _straggler_suspicion(
        flagged,
        "host_starved",
        lambda first, info: (
            f"rank {first}'s process waits {info['run_delay_ms_per_s']:.0f} ms per second for a CPU against "
            f"{info['peers_run_delay_ms_per_s']:.0f} ms/s of the job's other ranks, and its group (communicator "
            f"{info['communicator']}) waits {info['group_wait_s'] * 1e3:.2f} ms per collective against "
            f"{info['other_groups_wait_s'] * 1e3:.2f} ms in the job's {info['other_groups']} other groups"
        ),
    )


def step_time_up(state: JobState, thresholds: Thresholds, now: float) -> Finding | None:
    """The step time of the last windows against the job's own earlier steps (the first half of what
    is kept: a slow drift is measured against where the job started, not against itself)."""
    since = now - (STEP_CURRENT_WINDOWS + 0.5) * thresholds.window_s
    current = [value for received, value in state.step_times if received >= since]
    older = [value for received, value in state.step_times if received < since]
    baseline = older[: max(STEP_MIN_BASELINE, len(older) // 2)]
    if len(current) < STEP_CURRENT_WINDOWS or len(baseline) < STEP_MIN_BASELINE:
        return None
    base = statistics.median(baseline)
    spread = 1.4826 * statistics.median(abs(value - base) for value in baseline)
    now_step = statistics.median(current)
    if base <= 0 or now_step < base * (1 + STEP_RISE) or now_step - base <= STEP_SIGMAS * spread:
        return None
    return suspected(
        FindingKind.FAIL_SLOW,
        [],
        f"step time {now_step * 1e3:.1f} ms, {100 * (now_step / base - 1):.0f}% above the job's baseline "
        f"{base * 1e3:.1f} ms",
        {"source": "step_time", "step_s": round(now_step, 6), "baseline_s": round(base, 6)},
    )
