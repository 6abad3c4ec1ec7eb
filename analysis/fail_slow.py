"""Fail-slow: the job's step time rises against its own history, with onset and degradation.

The step is found from the periodic call pattern: of the collective signatures (communicator, op,
count) that every rank repeats at least ``MIN_STEPS`` times, the one with the longest typical gap
between its calls marks one iteration (the loss or gradient AllReduce). The step-time series is the
median, over the ranks, of the gaps between those calls. The baseline is the first third of the run
(its median, and its noise: the smaller of the steps' MAD and their spread from one step to the
next, which load on a shared machine inflates in different ways); onset is the first step of ``RUN``
consecutive steps above baseline + k*noise and at least ``MIN_RISE`` slower (k-sigma rather than a
change-point fit: it is cheap enough to run on every window, and the run length stops single
outliers); the steps after it must stay slower (median rise >= ``MIN_RISE``, most of them high), or
it was a burst that passed; of such onsets the first after which the job never ran ``RUN`` steps in
a row at its old pace again (a burst before the real onset is not it). The ranks behind it are the
stragglers of the steps after the onset.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rankwatch.analysis.findings import Finding, comm_label
from rankwatch.analysis.late_windows import NOT_LOCALISABLE_FROM_CALLS
from rankwatch.analysis.trace import Trace, is_collective

MIN_STEPS = 12
RUN = 3
K = 6.0
MIN_RISE = 0.20  # a slowdown worth acting on; a shared or busy machine drifts 10-15% on its own


def _marker_times(calls: np.ndarray) -> np.ndarray | None:
    """Call times of one rank's step marker: of the collective signatures (communicator, op, count)
    it repeats at least MIN_STEPS times, the one with the longest typical gap between its calls."""
    calls = calls[is_collective(calls["op"])]
    if len(calls) < MIN_STEPS:
        return None
    signature = (calls["comm"] * np.uint64(0x9E3779B97F4A7C15)) ^ (calls["op"].astype(np.uint64) << np.uint64(56))
    signature ^= calls["count"]
    _, index, counts = np.unique(signature, return_inverse=True, return_counts=True)
    best: tuple[float, np.ndarray] | None = None
    for position in np.flatnonzero(counts >= MIN_STEPS).tolist():
        times = np.sort(calls["t_call"][index == position])
        typical = float(np.median(np.diff(times)))
        if best is None or typical > best[0]:
            best = (typical, times)
    return best[1] if best else None


def step_times(trace: Trace, sample: int = 64) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(step start times, step durations in ns, marker communicator) or None without a period.

    Every rank takes part in every step, so a sample of ranks spread over the job (each with its own
    marker: its DP group's AllReduce is another communicator than its neighbour's) gives the job's
    step time; the series is the median over them, step by step, of the most recent common steps."""
    ranks = sorted(trace.ranks) or np.unique(trace.calls["rank"]).tolist()
    chosen = sorted({ranks[i] for i in np.linspace(0, len(ranks) - 1, min(sample, len(ranks))).astype(int)})
    series, marker = [], 0
    for rank in chosen:
        own = trace.calls[trace.rows_of(rank)]
        times = _marker_times(own)
        if times is not None:
            series.append(times)
            if not marker:
                marker = int(own["comm"][np.searchsorted(own["t_call"], times[0])])
    if not series:
        return None
    steps = min(len(times) for times in series)
    if steps < MIN_STEPS:
        return None
    recent = np.stack([times[-steps:] for times in series])
    durations = np.median(np.diff(recent, axis=1), axis=0)
    starts = np.median(recent[:, 1:], axis=0)
    return starts, durations, marker


def step_time_rise(durations: np.ndarray) -> tuple[int, float, float, float, float] | None:
    """(onset index, rise, baseline, median after onset, share of high steps after it) of a lasting
    rise of a step-time series against its first third, or None."""
    base = durations[: max(MIN_STEPS // 3, len(durations) // 3)]
    baseline = float(np.median(base))
    spread = step_noise(base) + 1e3
    high = (durations > baseline + K * spread) & (durations > baseline * (1 + MIN_RISE))
    runs = np.convolve(high.astype(int), np.ones(RUN, int), mode="valid") == RUN
    # the job must have stayed slower for a while: a few slow steps at the end of a short trace are not
    # a trend, and a burst that passed (a busy machine, a checkpoint) is skipped
    candidates = [onset for onset in np.flatnonzero(runs).tolist() if len(durations) - onset >= 2 * RUN]
    held = []
    for onset in candidates:
        after = float(np.median(durations[onset:]))
        rise = after / baseline - 1
        if rise >= MIN_RISE and high[onset:].mean() >= 0.5:
            held.append((onset, rise, baseline, after, float(high[onset:].mean())))
    # a busy machine only ever adds to a step: steps back at the old pace (nearer the baseline than the
    # pace after the onset), RUN in a row, say the job could still keep it, so that onset was a burst
    # of load; the first onset without such steps after it is the rise (a rise that comes and goes has
    # them after every onset: its first one stands)
    lasting = (found for found in held if not _back_at_old_pace(durations, found[0], found[2], found[3]))
    return next(lasting, held[0] if held else None)


def _back_at_old_pace(durations: np.ndarray, onset: int, baseline: float, after: float) -> bool:
    """Whether RUN steps in a row after ``onset`` ran nearer ``baseline`` than ``after``."""
    old_pace = durations[onset:] < (baseline + after) / 2
    return bool(len(old_pace) >= RUN and (np.convolve(old_pace.astype(int), np.ones(RUN, int), "valid") == RUN).any())


def step_noise(durations: np.ndarray) -> float:
    """The noise of a step-time series, as one standard deviation: the smaller of 1.4826 x the MAD of
    its steps and 1.4826 x the median absolute difference of consecutive steps over sqrt 2. A busy
    machine only ever adds to steps, in two shapes that each inflate one of them: a burst of slow
    steps that fills a good part of the series grows the MAD (at load 8 enough to hide a doubled
    step) but moves only the differences at its edges; single slow steps here and there move two
    differences each, the MAD once."""
    if len(durations) < 2:
        return 0.0
    spread = 1.4826 * float(np.median(np.abs(durations - np.median(durations))))
    return min(spread, 1.4826 * float(np.median(np.abs(np.diff(durations)))) / 2**0.5)


def detect_fail_slow(trace: Trace, culprits_after: Callable[[int], list[int]] | None = None) -> list[Finding]:
    """``culprits_after(onset_ns)``: the ranks behind a rise, asked for only when there is one."""
    series = step_times(trace)
    if series is None:
        return []
    starts, durations, marker = series
    found = step_time_rise(durations)
    if found is None:
        return []
    onset, rise, baseline, after, high = found
    ranks = sorted(culprits_after(int(starts[onset]))) if culprits_after else []
    who = f"; ranks behind it: {', '.join(trace.label(r) for r in ranks)}" if ranks else ""
    if not ranks and culprits_after and not trace.has_returns and not trace.calls_block_on_host:
        who = f"; the ranks behind it are {NOT_LOCALISABLE_FROM_CALLS}"
    return [
        Finding(
            kind="fail_slow",
            ranks=ranks,
            nodes=sorted({trace.node_of(r) for r in ranks}),
            communicator=comm_label(marker),
            confidence=round(float(min(1.0, high * min(1.0, rise / (3 * MIN_RISE)))), 3),
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
