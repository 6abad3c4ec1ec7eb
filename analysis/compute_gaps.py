"""Stragglers from GPU compute time: how long each GPU computes a step outside NCCL.

Wait times inside one collective find a slow member only when it has peers doing the same work in
that collective (tensor parallelism), and even there a 5% slowdown hides in the waits' noise. With
TP=1 a slow GPU passes its delay down the pipeline and its data-parallel peers meet it once a step.
GPU times say more: between the GPU end of one NCCL operation and the GPU start of the next the GPU
computes. A slow GPU computes longer each step than its peers of the same pipeline stage (the ranks
it shares a collective communicator with, smaller than the world: its TP and DP peers); when a stage
has fewer than three ranks, all ranks are the reference. Used when the waits name nobody.

Steps, not time windows: the compared ranks' steps run between the ends of a collective they all
take part in, the least often called (the grad norm's world AllReduce, once a step), so a step holds
the same work for every rank. Windows cut at fixed times held more of the late pipeline stages' work
in some windows and less in others (a healthy 8-rank TP1 PP8 run named its last stage).
A host starved of CPU leaves its GPU idle, and that idle time falls between NCCL operations too,
only ever adding: each gap of a step (the k-th gap of every step with the usual number of gaps) is
taken at its least over the steps, and their sum is what the GPU computes a step. The noise floor
comes from the run: three times the spread of the ranks' excess (more with many ranks), at least
2.5%. A run whose floor exceeds 10% is not judged, nor a rank with fewer than six such steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from rankwatch.analysis.findings import Finding
from rankwatch.analysis.trace import Trace, is_p2p

MIN_EXCESS = 0.025  # a GPU computing less than 2.5% more than its peers is not reported ...
NOISE_FACTOR = 3.0  # ... nor one within this many times the run's own spread
MIN_STEPS = 6  # steps (windows between two of the group's shared collectives) a judgement needs
MIN_CALLS = 20  # GPU-timed calls a rank needs to be judged
MAX_FLOOR = 0.10  # a run whose ranks spread more than this around their peers is too noisy to judge


def _timed_calls(trace: Trace) -> dict[int, np.ndarray]:
    """rank -> its GPU-timed calls (rows of ``trace.calls``) in GPU start order."""
    calls = trace.calls
    out = {}
    for rank in sorted(trace.ranks):
        own = calls[trace.rows_of(rank)]
        own = own[(own["gpu_start"] > 0) & (own["gpu_end"] >= own["gpu_start"])]
        if len(own) >= MIN_CALLS:
            out[rank] = own[np.argsort(own["gpu_start"], kind="stable")]
    return out


@dataclass(frozen=True)
class QuietCompute:
    """One rank's GPU compute of one step (each gap at its least over the steps, summed), the steps
    it was read from, each step's own compute (NaN where the step had another number of gaps), and
    each gap of each step (``[step, position]``, NaN rows where the step had another number)."""

    total: float
    steps: int
    per_step: np.ndarray
    gaps: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))


def _quiet_step_compute(own: np.ndarray, edges: np.ndarray) -> QuietCompute:
    """``own``'s rank's compute of one step: the least of each of its step's gaps between NCCL
    operations over the steps between ``edges`` that have the usual number of gaps, summed. A host
    starved of CPU leaves its GPU idle inside some gaps; idle time only ever adds, and it rarely hits
    the same gap in every step."""
    per_step = np.full(max(len(edges) - 1, 0), np.nan)
    if len(edges) <= MIN_STEPS:  # no shared boundaries (a wrapped ring), or too few steps
        return QuietCompute(0.0, max(len(edges) - 1, 0), per_step)
    busy_until = np.maximum.accumulate(own["gpu_end"][:-1].astype(np.int64))  # streams may overlap
    next_start = own["gpu_start"][1:].astype(np.int64)
    gap = np.maximum(next_start - busy_until, 0)
    step = np.searchsorted(edges, busy_until, "right") - 1  # an edge is an operation's end: gaps start after it
    inside = (step >= 0) & (step < len(edges) - 1)
    inside &= next_start <= edges[np.minimum(step + 1, len(edges) - 1)]
    gaps_of = [gap[inside & (step == k)] for k in range(len(edges) - 1)]
    usual = int(np.bincount([len(gaps) for gaps in gaps_of]).argmax()) if gaps_of else 0
    alike = [k for k, gaps in enumerate(gaps_of) if len(gaps) == usual]
    if not usual or len(alike) < MIN_STEPS:
        return QuietCompute(0.0, len(alike), per_step)
    stacked = np.stack([gaps_of[k] for k in alike])
    per_step[alike] = stacked.sum(axis=1)
    gaps = np.full((len(per_step), usual), np.nan)
    gaps[alike] = stacked
    return QuietCompute(float(stacked.min(axis=0).sum()), len(alike), per_step, gaps)


def _step_comms(trace: Trace) -> list[tuple[float, int, int, frozenset[int]]]:
    """(calls per member, size, id, members) of each collective communicator, least often called first:
    a world AllReduce once a step (the grad norm) ends at about the same time on each member, so the
    windows between its ends hold the same whole steps for all."""
    calls = trace.calls
    comm_ids, counts = np.unique(calls["comm"][~is_p2p(calls["op"])], return_counts=True)
    return sorted(
        (int(count) / comm.size, comm.size, comm.id, frozenset(comm.members.values()))
        for comm_id, count in zip(comm_ids.tolist(), counts.tolist(), strict=True)
        if (comm := trace.comms.get(comm_id)) is not None
    )


class _StepCompute:
    """Each rank's GPU compute of one step (:func:`_quiet_step_compute`) between a communicator's
    operations, read once per rank and set of steps (many ranks share a reference)."""

    def __init__(self, trace: Trace, timed: dict[int, np.ndarray]) -> None:
        self.timed, self.comms = timed, _step_comms(trace)
        self.ends: dict[tuple[int, int], dict[int, int]] = {}
        self.read: dict[tuple[int, int, tuple[int, ...]], QuietCompute] = {}

    def _ends(self, rank: int, comm_id: int) -> dict[int, int]:
        """sequence number -> GPU end of ``rank``'s operations on ``comm_id``"""
        if (rank, comm_id) not in self.ends:
            own = self.timed[rank]
            mine = own[own["comm"] == comm_id]
            self.ends[rank, comm_id] = dict(zip(mine["seq"].tolist(), mine["gpu_end"].tolist(), strict=True))
        return self.ends[rank, comm_id]

    def of(self, group: list[int]) -> list[QuietCompute] | None:
        """Each member's compute of one step, between consecutive operations of the least often called
        communicator holding the whole group that every member's GPU ended (matched by sequence
        number: the members' per-step series line up). None when there is no such communicator or a
        member has fewer than MIN_STEPS steps."""
        members = set(group)
        comm_id = next((comm_id for *_, comm_id, held in self.comms if members <= held), None)
        if comm_id is None:
            return None
        ends = [self._ends(rank, comm_id) for rank in group]
        shared = tuple(sorted(set.intersection(*(set(e) for e in ends))))
        for rank, own_ends in zip(group, ends, strict=True):
            if (rank, comm_id, shared) not in self.read:
                edges = np.array([own_ends[seq] for seq in shared], np.int64)
                self.read[rank, comm_id, shared] = _quiet_step_compute(self.timed[rank], edges)
        compute = [self.read[rank, comm_id, shared] for rank in group]
        return compute if compute and all(c.steps >= MIN_STEPS for c in compute) else None


def stage_peers(trace: Trace) -> dict[int, set[int]]:
    """rank -> the ranks it shares a collective communicator with, smaller than the world (its
    tensor- and data-parallel peers: one pipeline stage), itself included."""
    world = len(trace.ranks)
    calls = trace.calls
    collective_comms = set(np.unique(calls["comm"][~is_p2p(calls["op"])]).tolist())
    peers: dict[int, set[int]] = {rank: {rank} for rank in trace.ranks}
    for comm_id in collective_comms:
        comm = trace.comms.get(comm_id)
        if comm is None or not 2 <= comm.size < world:
            continue
        members = set(comm.members.values())
        for rank in members & peers.keys():
            peers[rank] |= members
    return peers


@dataclass
class StepExcess:
    """Each judged rank's compute a step against its stage peers', and the run's noise floor."""

    ranks: list[int]
    excess: np.ndarray  # own / peers' - 1, NaN where not judged
    steps: np.ndarray
    total_ms: np.ndarray
    reference_ms: np.ndarray
    floor: float  # the excess a rank needs to stand out: the run's spread, at least MIN_EXCESS
    peers: dict[int, set[int]]
    longer_steps: np.ndarray  # steps in which the rank computed longer than its peers' median ...
    compared_steps: np.ndarray  # ... of the steps all of them had with the usual gaps (a sign test)
    step_compute: _StepCompute | None = field(default=None, repr=False)

    def paired_lateness(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Ranks ``a`` and ``b``'s lateness in each step (its compute minus the median of its stage
        peers'), over the steps of one communicator holding both and their peers (the world's
        once-a-step AllReduce), so that ranks of different stages compare step by step; NaN where a
        step had another number of gaps. None without such a communicator or steps enough."""
        if self.step_compute is None:
            return None
        timed = set(self.step_compute.timed)
        group = sorted((self.peers.get(a, {a}) | self.peers.get(b, {b}) | {a, b}) & timed)
        compute = self.step_compute.of(group)
        if compute is None:
            return None
        per_step = dict(zip(group, (c.per_step for c in compute), strict=True))

        def lateness(rank: int) -> np.ndarray | None:
            peers = [per_step[r] for r in sorted(self.peers.get(rank, {rank}) - {rank}) if r in per_step]
            return per_step[rank] - np.median(np.stack(peers), axis=0) if rank in per_step and peers else None

        late_a, late_b = lateness(a), lateness(b)
        return None if late_a is None or late_b is None else (late_a, late_b)


def step_excess(trace: Trace, min_stage: int = 3) -> StepExcess | None:
    """Per rank, how much longer it computes a step than its stage's peers (see the module); a stage
    of fewer than ``min_stage`` ranks is compared with every rank. None when fewer than three ranks
    can be judged. (Of two stage peers each is compared with the other: only the longer can stand
    out; where stages differ in their work, as a pipeline's do, that beats comparing across stages.)"""
    timed = _timed_calls(trace)
    if len(timed) < 3:
        return None
    ranks = list(timed)
    peers = stage_peers(trace)
    excess = np.full(len(ranks), np.nan)
    steps = np.zeros(len(ranks), int)
    total, reference = np.zeros(len(ranks)), np.zeros(len(ranks))
    longer, compared = np.zeros(len(ranks), int), np.zeros(len(ranks), int)
    step_compute = _StepCompute(trace, timed)
    for i, rank in enumerate(ranks):
        group = [r for r in sorted(peers.get(rank, {rank})) if r in timed]
        group = group if len(group) >= min_stage else ranks
        compute = step_compute.of(group)
        if compute is None:
            continue
        mine = compute[group.index(rank)]
        # of two, the peer is the reference (the median of both would halve the difference)
        compared_with = compute if len(compute) > 2 else [c for c in compute if c is not mine]
        own, typical = mine.total, float(np.median([c.total for c in compared_with]))
        if typical <= 0:
            continue
        excess[i] = own / typical - 1
        steps[i], total[i], reference[i] = mine.steps, own / 1e6, typical / 1e6
        others = np.stack([c.per_step for c in compute if c is not mine])
        both = ~np.isnan(mine.per_step) & ~np.isnan(others).any(axis=0)
        longer[i] = int((mine.per_step[both] > np.median(others[:, both], axis=0)).sum())
        compared[i] = int(both.sum())
    judged = ~np.isnan(excess)
    if judged.sum() < 3:
        return None
    spread = excess[judged]
    noise = 1.4826 * float(np.median(np.abs(spread - np.median(spread))))
    # many ranks reach further into the noise's tail: the floor keeps the chance of one false rank ~0.2%
    tail = max(NOISE_FACTOR, NormalDist().inv_cdf(1 - 0.002 / len(ranks)))
    floor = max(MIN_EXCESS, tail * noise)
    return StepExcess(ranks, excess, steps, total, reference, floor, peers, longer, compared, step_compute)


def detect_compute_stragglers(trace: Trace, explained: frozenset[int] = frozenset()) -> list[Finding]:
    """Ranks whose GPU computes longer each step than their stage's peers (GPU-timed traces only);
    ``explained``: ranks another finding already accounts for (slow-link endpoints)."""
    measured = step_excess(trace)
    if measured is None or measured.floor > MAX_FLOOR:
        return []
    ranks, excess, floor, peers = measured.ranks, measured.excess, measured.floor, measured.peers
    steps, total, reference = measured.steps, measured.total_ms, measured.reference_ms
    judged = ~np.isnan(excess)
    flagged = [i for i in np.argsort(-np.nan_to_num(excess, nan=-np.inf)) if judged[i] and excess[i] >= floor]
    # more than one slow GPU per eight is the job's structure (or a shared cause), not a straggler
    if len(flagged) > max(1, len(ranks) // 8):
        return []
    findings = []
    for i in flagged:
        rank = ranks[i]
        if rank in explained:
            continue
        findings.append(
            Finding(
                kind="straggler",
                ranks=[rank],
                nodes=[trace.node_of(rank)],
                communicator=None,
                confidence=round(float(min(1.0, excess[i] / (2 * floor))), 3),
                summary=(
                    f"{trace.label(rank)}'s GPU computes {total[i]:.2f} ms a step between its NCCL operations "
                    f"vs {reference[i]:.2f} ms for its peers ({excess[i]:+.1%}, above the run's noise floor "
                    f"{floor:.1%}; each gap at its least over {int(steps[i])} steps)"
                ),
                evidence={
                    "step_compute_ms": round(float(total[i]), 3),
                    "peer_step_compute_ms": round(float(reference[i]), 3),
                    "slowdown": round(float(excess[i]), 4),
                    "noise_floor": round(floor, 4),
                    "steps": int(steps[i]),
                    "own_compute": True,
                    "communicator_size": len(peers.get(rank, {rank})),
                },
            )
        )
    return findings
