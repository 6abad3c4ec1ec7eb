"""Fail-slow: the job's step time rises against its own history, with onset and degradation.

The step is found from the periodic call pattern: of the collective signatures (communicator, op,
count) that every rank repeats at least ``MIN_STEPS`` times, the one with the longest typical gap
between its calls marks one iteration (the loss or gradient AllReduce). The step-time series is the
median, over the ranks, of the gaps between those calls. The baseline is the first third of the run
(median and MAD); onset is the first step of ``RUN`` consecutive steps above baseline + k*MAD and
at least ``MIN_RISE`` slower (k-sigma rather than a change-point fit: it is cheap enough to run on
every window, and the run length stops single outliers). The ranks behind it are the stragglers of
the steps after the onset.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rankwatch.analysis.findings import Finding, comm_label
from rankwatch.analysis.trace import COLLECTIVE_OPS, Trace

MIN_STEPS = 12
RUN = 3
K = 6.0
MIN_RISE = 0.10


def step_times(trace: Trace) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(step start times, step durations in ns, marker communicator) or None without a period."""
    calls = trace.calls[np.isin(trace.calls["op"], COLLECTIVE_OPS)]
    if not len(calls) or not trace.ranks:
        return None
    best: tuple[float, np.ndarray, np.ndarray, int] | None = None
    for comm_id in np.unique(calls["comm"]):
        mine = calls[calls["comm"] == comm_id]
        for op in np.unique(mine["op"]):
            same = mine[mine["op"] == op]
            for count in np.unique(same["count"]):
                marker = same[same["count"] == count]
                ranks = np.unique(marker["rank"])
                per_rank = np.bincount(np.searchsorted(ranks, marker["rank"]))
                steps = int(per_rank.min())
                if steps < MIN_STEPS or per_rank.max() != steps:
                    continue
                times = np.stack([np.sort(marker["t_call"][marker["rank"] == r])[:steps] for r in ranks])
                starts = np.median(times, axis=0)
                gaps = np.diff(starts)
                typical = float(np.median(gaps))
                if best is None or typical > best[0]:
                    best = (typical, starts[1:], gaps, int(comm_id))
    if best is None:
        return None
    return best[1], best[2], best[3]


def detect_fail_slow(trace: Trace, culprits_after: Callable[[int], list[int]] | None = None) -> list[Finding]:
    """``culprits_after(onset_ns)``: the ranks behind a rise, asked for only when there is one."""
    series = step_times(trace)
    if series is None:
        return []
    starts, durations, marker = series
    base = durations[: max(MIN_STEPS // 3, len(durations) // 3)]
    baseline = float(np.median(base))
    spread = 1.4826 * float(np.median(np.abs(base - baseline))) + 1e3
    high = (durations > baseline + K * spread) & (durations > baseline * (1 + MIN_RISE))
    runs = np.convolve(high.astype(int), np.ones(RUN, int), mode="valid") == RUN
    if not runs.any():
        return []
    onset = int(np.argmax(runs))
    after = float(np.median(durations[onset:]))
    rise = after / baseline - 1
    ranks = sorted(culprits_after(int(starts[onset]))) if culprits_after else []
    who = f"; ranks behind it: {', '.join(trace.label(r) for r in ranks)}" if ranks else ""
    return [
        Finding(
            kind="fail_slow",
            ranks=ranks,
            nodes=sorted({trace.node_of(r) for r in ranks}),
            communicator=comm_label(marker),
            confidence=round(float(min(1.0, high[onset:].mean() * min(1.0, rise / (3 * MIN_RISE)))), 3),
            summary=(
                f"the step time rose {rise:.0%} from step {onset + 1}: {after / 1e6:.2f} ms against "
                f"{baseline / 1e6:.2f} ms before (steps from the period of {trace.comm_name(marker)}){who}"
            ),
            evidence={
                "onset_step": onset + 1,
                "onset_time_ns": int(starts[onset]),
                "baseline_step_ms": round(baseline / 1e6, 4),
                "step_ms_after": round(after / 1e6, 4),
                "degradation": round(rise, 4),
                "steps": len(durations),
            },
        )
    ]
