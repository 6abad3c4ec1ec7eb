"""Statistics for judging a rank against the noise measured in its own job.

Detectors compare a rank's effect (a delay, a slower transfer, a window of lateness) with the spread of
the same quantity over the job's other ranks, instances or pairs, instead of with fixed milliseconds: a
job with another step time, other hosts or another timer gets a bar of its own. One false name in about
``1 / FALSE_RANK_CHANCE`` healthy jobs is what every bar here aims at.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

FALSE_RANK_CHANCE = 0.002  # a healthy job of N ranks (pairs, ...) has one of them named this rarely
MAD_TO_SIGMA = 1.4826  # 1.4826 x the median absolute deviation estimates a normal spread's sigma


def sign_tail(successes: np.ndarray, trials: np.ndarray) -> np.ndarray:
    """P(X >= successes) for X ~ Binomial(trials, 1/2), via the normal approximation above 60 trials."""
    out = np.ones(len(successes))
    tails: dict[tuple[int, int], float] = {}  # thousands of ranks share a few (successes, trials)
    for i, (k, n) in enumerate(zip(successes.tolist(), trials.tolist(), strict=True)):
        tail = tails.get((k, n))
        if tail is None:
            tail = tails[(k, n)] = (
                _binomial_tail(k, n, 0.5) if n <= 60 else 0.5 * math.erfc((k - 0.5 - n / 2) / math.sqrt(n / 4) / 2**0.5)
            )
        out[i] = tail
    return out


def _binomial_tail(successes: int, trials: int, p: float) -> float:
    return float(sum(math.comb(trials, k) * p**k * (1 - p) ** (trials - k) for k in range(successes, trials + 1)))


def student_tail(quantile: float, freedom: int) -> float:
    """Student's t quantile (Cornish-Fisher from the normal one): a spread measured from the same few
    values it judges needs a rank to stand further out than a normal tail says."""
    z = NormalDist().inv_cdf(quantile)
    if freedom < 1:
        return float("inf")
    n = float(freedom)
    return (
        z
        + (z**3 + z) / (4 * n)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * n**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * n**3)
    )


def chance_tail(judged: int, freedom: int | None = None) -> float:
    """The z the most extreme of ``judged`` healthy values reaches about once in 1 / FALSE_RANK_CHANCE
    jobs, their spread measured from ``freedom`` + 1 values (by default the judged ones themselves)."""
    freedom = judged - 1 if freedom is None else freedom
    if judged < 1 or freedom < 1:
        return float("inf")
    return student_tail(1 - FALSE_RANK_CHANCE / judged, freedom)


def robust_spread(values: np.ndarray) -> float:
    """1.4826 x MAD of the finite values: one standard deviation, barely moved by the few outliers judged."""
    finite = np.asarray(values, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    if not len(finite):
        return 0.0
    return MAD_TO_SIGMA * float(np.median(np.abs(finite - np.median(finite))))


def median_standard_error(values: np.ndarray) -> float:
    """The standard error of the median of ``values`` (sqrt(pi / 2) x sigma / sqrt(n)), sigma robustly."""
    finite = np.asarray(values, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    if not len(finite):
        return float("inf")
    return math.sqrt(math.pi / 2) * robust_spread(finite) / math.sqrt(len(finite))


def clock_tick_ns(times: np.ndarray) -> int:
    """The measured resolution of a set of timestamps (ns): the largest power of ten, up to a second,
    that divides every recorded one. Clocks that keep microseconds (or a timer of coarser grain) write
    multiples of it; a difference of two such readings is uncertain by one tick, so no delay shorter
    than that is a measurement. 1 for a nanosecond clock; at least 1 with no timestamps."""
    recorded = np.asarray(times, dtype=np.int64)
    # a few readings bound the tick from above: a nanosecond clock is told without a pass over millions
    upper = _largest_tick(recorded[:TICK_SAMPLE], SECOND_NS)
    if upper == 1:
        return 1
    return _largest_tick(recorded, upper or SECOND_NS) or 1


def clock_tick_at(column: np.ndarray, rows: np.ndarray) -> int:
    """``clock_tick_ns(column[rows])``, gathering millions of readings only when the first ones do not
    already tell a nanosecond clock."""
    upper = _largest_tick(np.asarray(column[rows[:TICK_SAMPLE]], dtype=np.int64), SECOND_NS)
    if upper == 1:
        return 1
    return _largest_tick(np.asarray(column[rows], dtype=np.int64), upper or SECOND_NS) or 1


TICK_SAMPLE = 4096
SECOND_NS = 1_000_000_000


def _largest_tick(times: np.ndarray, upper: int) -> int | None:
    """The largest power of ten up to ``upper`` that divides every positive one of ``times``; None
    when none is positive."""
    recorded = times[times > 0]
    if not len(recorded):
        return None
    tick = 1
    while tick < upper and not np.any(recorded % (tick * 10)):
        tick *= 10
    return tick
