"""Stragglers and slowdowns from recorded compute spans (MegaScan: the CUDA time of each microbatch's
forward and backward, per model chunk, and each iteration's time).

Against peers: ranks of one pipeline stage (its TP and DP peers) do the same work for the same
microbatch, model chunk and iteration, so each span is compared with the median of that cell over the
stage's ranks (cells with at least two ranks: of two, the longer is above their median by half the
difference, the other below). A rank's effect is the median of its log ratios; the
noise floor comes from the run: the ranks' spread of effects (MAD; more with many ranks, at least
2.5%, as for ``compute_gaps``), and the rank must be longer in far more cells than chance allows
(sign test). A span holds the rank's TP collectives, where its TP peers wait for it: a slow rank's
TP peers come out slower too: the communication recorded inside a span (``--trace-granularity
full``) is taken out of it, and without it spans of a TP>1 run name nobody; of several flagged
members of one TP group only one that stands above the others by the floor is named.

Against its own history: the job's iteration time (median over ranks, CUDA when recorded) is a step
series for ``fail_slow.step_time_rise``; the ranks behind a rise are those whose own compute per
iteration rose likewise while the others' did not (none when all rose alike: a shared cause).
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

from rankwatch.analysis.compute_gaps import MAX_FLOOR, MIN_EXCESS, NOISE_FACTOR
from rankwatch.analysis.fail_slow import MIN_RISE, MIN_STEPS, step_time_rise
from rankwatch.analysis.findings import Finding
from rankwatch.analysis.instances import grouped_median
from rankwatch.analysis.trace import Trace

MIN_CELLS = 6  # spans a rank needs compared with its peers to be judged
# a cell's median needs this many ranks: of two peers doing the same work, the longer stands above their
# mean by half their difference, the other below it, so only the longer can pass the floor
MIN_STAGE_RANKS = 2
MIN_JUDGED = 3  # ranks whose spread of effects gives the noise floor
SIGN_P = 1e-4  # the chance that a healthy rank is longer in this many cells (divided by the ranks)


def compute_ns(spans: np.ndarray) -> np.ndarray:
    """Each span's compute: its time less the communication recorded inside it (waits for peers)."""
    return (spans["end"] - spans["start"] - spans["comm_ns"]).astype(np.float64)


def holds_unrecorded_waits(trace: Trace) -> bool:
    """With tensor parallelism a span holds the rank's TP collectives, where it waits for its TP peers;
    without those recorded (MegaScan's --trace-granularity full) its time is not its own compute."""
    spans = trace.spans
    return bool(trace.layout and trace.layout.tp > 1 and spans is not None and not (spans["comm_ns"] > 0).any())


def _sign_p(longer: int, cells: int) -> float:
    """P(X >= longer) for X ~ Binomial(cells, 1/2) (normal approximation)."""
    return 0.5 * math.erfc((longer - 0.5 - cells / 2) / math.sqrt(cells / 4) / math.sqrt(2))


def _stage_effects(trace: Trace) -> dict[int, tuple[float, int, int, float, float]]:
    """rank -> (excess over its stage's median, cells, cells where it was longer, its median span ms,
    the stage's median span ms) for ranks with at least MIN_CELLS cells."""
    spans, layout = trace.spans, trace.layout
    if spans is None or layout is None or not len(spans):
        return {}
    duration = compute_ns(spans)
    keep = duration > 0
    spans, duration = spans[keep], duration[keep]
    stage = spans["rank"] // (layout.tp * layout.dp)
    keys = np.stack([stage, spans["iteration"], spans["kind"], spans["chunk"], spans["microbatch"]], axis=1)
    _, cell, counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    cell = cell.reshape(-1)
    ranks_in = np.bincount(cell, minlength=len(counts))
    shared = ranks_in[cell] >= MIN_STAGE_RANKS
    if not shared.any():
        return {}
    median = grouped_median(duration, cell, len(counts))[cell]
    ratio = np.log(duration / median)
    ranks, who = np.unique(spans["rank"][shared], return_inverse=True)
    n = len(ranks)
    effect = grouped_median(ratio[shared], who, n)
    cells = np.bincount(who, minlength=n)
    longer = np.bincount(who, weights=(ratio[shared] > 0).astype(np.float64), minlength=n).astype(int)
    own = grouped_median(duration[shared], who, n) / 1e6
    typical = grouped_median(median[shared], who, n) / 1e6
    return {
        int(ranks[i]): (math.expm1(float(effect[i])), int(cells[i]), int(longer[i]), float(own[i]), float(typical[i]))
        for i in np.flatnonzero(cells >= MIN_CELLS).tolist()
    }


def _tp_group(trace: Trace, rank: int) -> int:
    return rank // trace.layout.tp if trace.layout else rank


def detect_span_stragglers(trace: Trace, explained: frozenset[int] = frozenset()) -> tuple[list[Finding], list[str]]:
    """(stragglers, notes): ranks whose forward/backward compute is longer than their pipeline
    stage's; notes say what the comparison measured (or why it could not judge)."""
    effects = _stage_effects(trace)
    if not effects:
        if trace.spans is not None and trace.layout is not None:
            per_stage = trace.layout.tp * trace.layout.dp
            return [], [
                f"compute spans: {per_stage} rank(s) per pipeline stage (TP x DP): no peers doing the same work; "
                "each rank is compared with its own history only"
            ]
        return [], []
    if len(effects) < MIN_JUDGED:
        return [], [f"compute spans: {len(effects)} ranks with peers, too few to measure the run's spread"]
    ranks = sorted(effects)
    excess = np.array([effects[r][0] for r in ranks])
    noise = 1.4826 * float(np.median(np.abs(excess - np.median(excess))))
    tail = max(NOISE_FACTOR, NormalDist().inv_cdf(1 - 0.002 / len(ranks)))
    floor = max(MIN_EXCESS, tail * noise)
    measured = (
        f"compute spans against their pipeline stage's ranks: {len(ranks)} ranks within "
        f"{float(np.min(excess)):+.1%}..{float(np.max(excess)):+.1%} (spread {noise:.1%}, noise floor {floor:.1%})"
    )
    if floor > MAX_FLOOR:
        return [], [f"{measured}: too noisy to judge"]
    if holds_unrecorded_waits(trace):
        return [], [
            f"{measured}; the spans hold TP collectives that were not recorded (MegaScan's --trace-granularity "
            "full records them): a rank's waits for its TP peers cannot be told from its compute, nobody is named"
        ]
    flagged = [
        r for r in ranks if effects[r][0] >= floor and _sign_p(effects[r][2], effects[r][1]) <= SIGN_P / len(ranks)
    ]
    notes = [measured]
    named = []
    for group in sorted({_tp_group(trace, r) for r in flagged}):
        members = sorted((r for r in flagged if _tp_group(trace, r) == group), key=lambda r: -effects[r][0])
        if len(members) > 1 and effects[members[0]][0] - effects[members[1]][0] < floor:
            notes.append(
                f"ranks {', '.join(map(str, sorted(members)))} (one TP group) compute longer together: their spans "
                "hold the TP collectives where they wait for one another; not localisable from the spans"
            )
            continue
        named.append(members[0])
    if len(named) > max(1, len(ranks) // 8):  # many at once: the job's structure or a shared cause
        notes.append(f"{len(named)} ranks above the floor at once: a shared cause, not a straggler")
        return [], notes
    findings = []
    for rank in sorted(named, key=lambda r: -effects[r][0]):
        if rank in explained:
            continue
        slowdown, cells, longer, own, typical = effects[rank]
        p_value = _sign_p(longer, cells)
        findings.append(
            Finding(
                kind="straggler",
                ranks=[rank],
                nodes=[trace.node_of(rank)],
                communicator=None,
                confidence=round(float(min(1.0, slowdown / (2 * floor))), 3),
                summary=(
                    f"{trace.label(rank)} computes its forward/backward spans in {own:.2f} ms (median) vs "
                    f"{typical:.2f} ms for its pipeline stage's ranks on the same microbatches ({slowdown:+.1%}, "
                    f"above the run's noise floor {floor:.1%}; longer in {longer} of {cells}, p {p_value:.1e})"
                ),
                evidence={
                    "span_ms": round(own, 3),
                    "peer_span_ms": round(typical, 3),
                    "slowdown": round(slowdown, 4),
                    "noise_floor": round(floor, 4),
                    "spans": cells,
                    "longer_in": longer,
                    "p_value": p_value,
                    "own_compute": True,
                },
            )
        )
    return findings, notes


def _series(values: np.ndarray, ranks: np.ndarray, iterations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[rank, iteration] sums of ``values`` over the iterations every rank has, and those iterations."""
    _, who = np.unique(ranks, return_inverse=True)
    numbers, which = np.unique(iterations, return_inverse=True)
    sums = np.zeros((int(who.max()) + 1 if len(who) else 0, len(numbers)))
    seen = np.zeros(sums.shape, bool)
    np.add.at(sums, (who, which), values)
    seen[who, which] = True
    common = seen.all(axis=0)
    return sums[:, common], numbers[common]


def detect_iteration_slowdown(trace: Trace) -> tuple[list[Finding], list[str]]:
    """(fail-slow finding, notes): the job's iteration time against its own first third, and the ranks
    whose own compute rose with it."""
    its = trace.iterations
    if its is None or not len(its):
        return [], []
    timed = np.where(its["cuda_ns"] > 0, its["cuda_ns"], its["wall_ns"]).astype(np.float64)
    matrix, numbers = _series(timed, its["rank"], its["iteration"])
    if len(numbers) < MIN_STEPS:
        return [], [f"{len(numbers)} iterations: fewer than {MIN_STEPS}, the iteration time is not judged"]
    job = np.median(matrix, axis=0)
    typical = float(np.median(job))
    spread = 1.4826 * float(np.median(np.abs(job - typical))) / typical
    found = step_time_rise(job)
    if found is None:
        own = _own_changes(trace, numbers)
        ranks = f"; each rank's compute per iteration {own[0]:+.1%}..{own[1]:+.1%} against its own" if own else ""
        return [], [
            f"iteration time {typical / 1e6:.1f} ms (median of {len(numbers)} iterations, spread {spread:.1%}): "
            f"no lasting rise of {MIN_RISE:.0%} against the first third{ranks}"
        ]
    onset, rise, baseline, after, high = found
    ranks = _ranks_behind(trace, numbers, onset)
    who = f"; ranks behind it: {', '.join(trace.label(r) for r in ranks)}" if ranks else ""
    return [
        Finding(
            kind="fail_slow",
            ranks=ranks,
            nodes=sorted({trace.node_of(r) for r in ranks}),
            communicator=None,
            confidence=round(float(min(1.0, high * min(1.0, rise / (3 * MIN_RISE)))), 3),
            summary=(
                f"the iteration time rose {rise:.0%} from iteration {int(numbers[onset])}: {after / 1e6:.2f} ms "
                f"against {baseline / 1e6:.2f} ms before{who}"
            ),
            evidence={
                "onset_iteration": int(numbers[onset]),
                "baseline_step_ms": round(baseline / 1e6, 4),
                "step_ms_after": round(after / 1e6, 4),
                "degradation": round(rise, 4),
                "steps": len(numbers),
            },
        )
    ], []


def _ranks_behind(trace: Trace, numbers: np.ndarray, onset: int) -> list[int]:
    """Ranks whose own compute per iteration rose by MIN_RISE from ``onset`` while most ranks' did not."""
    spans = trace.spans
    if spans is None or not len(spans) or holds_unrecorded_waits(trace):
        return []
    keep = np.isin(spans["iteration"], numbers)
    duration = compute_ns(spans)[keep]
    matrix, common = _series(duration, spans["rank"][keep], spans["iteration"][keep])
    names = np.unique(spans["rank"][keep])
    at = int(np.searchsorted(common, numbers[onset]))
    if at < 1 or at >= len(common):
        return []
    before = np.median(matrix[:, :at], axis=1)
    after = np.median(matrix[:, at:], axis=1)
    rose = (before > 0) & (after >= before * (1 + MIN_RISE))
    if rose.sum() > max(1, len(names) // 8):
        return []
    return sorted(names[rose].tolist())


def _own_changes(trace: Trace, numbers: np.ndarray) -> tuple[float, float] | None:
    """The least and largest change of a rank's median compute per iteration after the run's first
    third against that first third."""
    spans = trace.spans
    if spans is None or not len(spans):
        return None
    keep = np.isin(spans["iteration"], numbers)
    duration = compute_ns(spans)[keep]
    matrix, common = _series(duration, spans["rank"][keep], spans["iteration"][keep])
    third = max(MIN_STEPS // 3, len(common) // 3)
    if len(common) <= third:
        return None
    change = np.median(matrix[:, third:], axis=1) / np.maximum(np.median(matrix[:, :third], axis=1), 1) - 1
    return float(change.min()), float(change.max())
