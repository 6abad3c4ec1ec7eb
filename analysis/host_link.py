"""Slow pipeline links of a synchronous backend (gloo on CPU), from the call times of its collectives.

Gloo's flight recorder keeps no send or receive, and only when each collective was called. But a
receive that arrives late holds its receiver back before its next collective: the gap from its previous
collective's end to that call grows at the places of the step where it receives over the link (the
downstream end in the forward pass, the upstream end in the backward pass), while its peers' gaps there
do not. A rank slow in its own compute is late wherever it computes. So two pipeline neighbours, each
late at places of the step where the other computes and is on time, are the two ends of a slow link.

Steps run between the job's least often called collective (the world all-reduce); the k-th gap of
every step with the usual number of gaps is a position (host_compute.py's call-time gaps). Per rank,
step and position its lateness is its gap minus the median gap of its peers in that step: its TP group,
which meets it in every collective of a microbatch (its DP group with TP 1), not the other pipeline
replicas, whose ranks' sends do not block on the link. A rank is late *alone* at a position when
- its lateness there, median over the steps, stands out of its own step-to-step spread (z over the
  standard error of that median) by the Student tail that all positions of all pipeline pairs compared
  reach by chance once in 500 jobs (job_noise.py), and is at least 3% of its peers' gap there
  (straggler.py's floor) and one tick of the timestamps' resolution;
- its neighbour computes there (its peers' gap is at least half their typical one: being on time
  between two back-to-back collectives clears nothing) and is on time there (its median lateness below
  that 3% floor: not merely short of the bar, as a slow rank is where its peers wait long);
- the difference between the two ends, step by step, passes that bar too.
A link is named when each end is late alone somewhere: one beyond the job's bar, the other then beyond
the tail for that pair's positions alone (the pair is already singled out; what keeps a slow rank and
its passed-on neighbour out is the neighbour computing on time, not the bar). The evidence holds each
end's positions, its lateness there, the z values and the bar each end passed. A pair where only one
end is (a slow rank, and the lateness it passes on through sends that block on it) is not a link.
Pairs come from the layout (trace.unrecorded_partners): without it nobody is named.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from rankwatch.analysis.compute_gaps import MIN_STEPS, _StepCompute, _timed_calls
from rankwatch.analysis.findings import Finding
from rankwatch.analysis.host_compute import host_timed
from rankwatch.analysis.job_noise import FALSE_RANK_CHANCE, clock_tick_ns, median_standard_error, student_tail
from rankwatch.analysis.straggler import RELATIVE_DELAY
from rankwatch.analysis.topology import Layout
from rankwatch.analysis.trace import Trace

NEAR_SHARE = 0.5  # a neighbour that reaches this share of the bar where the other end is late alone: told


@dataclass(frozen=True)
class PositionLateness:
    """Per rank, ``[step, position]`` lateness (ns) behind the median of its peers' gaps, and those
    peers' median gap per position."""

    late: dict[int, np.ndarray]
    peer_gap: dict[int, np.ndarray]
    tick_ns: float


@dataclass(frozen=True)
class Lateness:
    """A lateness series' median over the steps (ns) and its z against its step-to-step spread."""

    ns: float
    z: float


@dataclass(frozen=True)
class Alone:
    """Where one end of a pair is late and the other computes on time: positions, the end's lateness
    there, and the z of the step-by-step difference between the two ends."""

    positions: list[int]
    lateness: list[Lateness]
    against_neighbour: list[float]
    bar: float  # the z each of them passed

    @property
    def late_ms(self) -> float:
        return sum(late.ns for late in self.lateness) / 1e6


def position_lateness(trace: Trace) -> PositionLateness | None:
    """The lateness of every rank at every position of the step (see the module); None without a
    layout, or when fewer than three ranks have MIN_STEPS whole steps."""
    layout = trace.layout
    if layout is None:
        return None
    timed_trace = host_timed(trace)
    timed = _timed_calls(timed_trace)
    if len(timed) < 3:
        return None
    compute = _StepCompute(timed_trace, timed).of(sorted(timed))
    if compute is None:
        return None
    gaps = {rank: c.gaps for rank, c in zip(sorted(timed), compute, strict=True) if c.gaps.size}
    late, peer_gap = {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # steps some peer had with other gaps: NaN
        for rank, own in gaps.items():
            others = [gaps[p] for p in sorted(_peers(layout, rank)) if p != rank and p in gaps]
            others = [g for g in others if g.shape == own.shape]
            if others:
                median = np.median(np.stack(others), axis=0)
                late[rank] = own - median
                peer_gap[rank] = np.nanmedian(median, axis=0)
    if len(late) < 3:
        return None
    return PositionLateness(late, peer_gap, float(clock_tick_ns(trace.calls["t_call"][trace.calls["t_call"] > 0])))


def _peers(layout: Layout, rank: int) -> set[int]:
    """The ranks ``rank`` is compared with: its TP group (its DP group with TP 1). Not its DP peers too:
    the other ranks of a slow link's pipeline replica wait for the link (their sends block on a receiver
    late to post its receive), so beside the other replicas they would show the link's pattern."""
    _, dp, stage = layout.coords(rank)
    if layout.tp > 1:
        return {r for r in range(layout.world_size) if layout.coords(r)[1:] == (dp, stage)}
    return {r for r in range(layout.world_size) if layout.coords(r)[2] == stage}


def _lateness(values: np.ndarray) -> Lateness:
    finite = values[np.isfinite(values)]
    if len(finite) < MIN_STEPS:
        return Lateness(0.0, 0.0)
    median = float(np.median(finite))
    error = median_standard_error(finite)
    return Lateness(median, median / error if error > 0 else (float("inf") if median > 0 else 0.0))


def _alone(measured: PositionLateness, rank: int, other: int, bar: float) -> Alone:
    """The positions where ``rank`` is late and ``other`` computes on time (see the module)."""
    own, theirs = measured.late[rank], measured.late[other]
    computes = measured.peer_gap[other] >= 0.5 * float(np.nanmedian(measured.peer_gap[other]))
    alone = Alone([], [], [], bar)
    for position in np.flatnonzero(computes).tolist():
        mine = _lateness(own[:, position])
        floor = max(measured.tick_ns, RELATIVE_DELAY * float(measured.peer_gap[rank][position]))
        if mine.z < bar or mine.ns < floor or not _on_time(measured, other, position):
            continue
        both = np.isfinite(own[:, position]) & np.isfinite(theirs[:, position])
        difference = _lateness(own[both, position] - theirs[both, position]).z
        if difference >= bar:
            alone.positions.append(position)
            alone.lateness.append(mine)
            alone.against_neighbour.append(difference)
    return alone


def _on_time(measured: PositionLateness, rank: int, position: int) -> bool:
    """``rank``'s lateness at ``position``, median over the steps, is below what counts as late there (3% of
    its peers' gap, one tick): on time, not merely not late enough to be sure of (a slow rank is late at
    every position where it computes, by less where its peers' waits are long)."""
    floor = max(measured.tick_ns, RELATIVE_DELAY * float(measured.peer_gap[rank][position]))
    return _lateness(measured.late[rank][:, position]).ns < floor


def _pairs(trace: Trace, measured: PositionLateness) -> list[tuple[int, int]]:
    """Pipeline neighbours (upstream, downstream) by the layout the trace was read with, whose steps
    have the same positions."""
    pairs = set()
    for rank, partners in trace.unrecorded_partners.items():
        for partner in partners:
            same = rank in measured.late and partner in measured.late
            if same and measured.late[rank].shape == measured.late[partner].shape:
                pairs.add((min(rank, partner), max(rank, partner)))
    return sorted(pairs)


def detect_host_links(trace: Trace, problems: list[str]) -> list[Finding]:
    """Slow links between pipeline neighbours of a synchronous backend's job (see the module);
    ``problems`` gets the numbers of a pair where one end is late alone and the other nearly."""
    if not trace.unrecorded_partners:
        return []
    measured = position_lateness(trace)
    if measured is None:
        return []
    pairs = _pairs(trace, measured)
    if not pairs:
        return []
    steps, positions = measured.late[pairs[0][0]].shape
    bar = student_tail(1 - FALSE_RANK_CHANCE / (len(pairs) * positions), steps - 1)
    # once one end stands out beyond the job's bar, the other is looked for in this pair's positions only
    pair_bar = student_tail(1 - FALSE_RANK_CHANCE / positions, steps - 1)
    findings = []
    for upstream, downstream in pairs:
        up, down = _alone(measured, upstream, downstream, bar), _alone(measured, downstream, upstream, bar)
        if up.positions and not down.positions:
            down = _alone(measured, downstream, upstream, pair_bar)
        elif down.positions and not up.positions:
            up = _alone(measured, upstream, downstream, pair_bar)
        if up.positions and down.positions:
            findings.append(_finding(trace, upstream, downstream, up, down, steps))
        elif up.positions or down.positions:
            (late_rank, late), on_time = (
                ((upstream, up), downstream) if up.positions else ((downstream, down), upstream)
            )
            near = _alone(measured, on_time, late_rank, NEAR_SHARE * pair_bar)
            if near.positions:
                problems.append(
                    f"{trace.label(late_rank)} is late behind its peers where its pipeline neighbour rank {on_time} "
                    f"computes on time ({_where(late)}), and rank {on_time} only nearly so where rank {late_rank} "
                    f"is ({_where(near)}; the other end needs z >= {pair_bar:.1f}): a slow link between them is not "
                    "localisable"
                )
    return findings


def _where(alone: Alone) -> str:
    return ", ".join(
        f"position {p}: {late.ns / 1e6:.2f} ms, z {late.z:.1f}, z against its neighbour {d:.1f}"
        for p, late, d in zip(alone.positions, alone.lateness, alone.against_neighbour, strict=True)
    )


def _finding(trace: Trace, upstream: int, downstream: int, up: Alone, down: Alone, steps: int) -> Finding:
    weakest = min(late.z for late in (*up.lateness, *down.lateness))
    return Finding(
        kind="slow_link",
        ranks=[upstream, downstream],
        nodes=sorted({trace.node_of(upstream), trace.node_of(downstream)}),
        communicator=None,
        confidence=round(float(min(1.0, weakest / (2 * max(up.bar, down.bar)))), 3),
        summary=(
            f"{trace.label(downstream)} waits {down.late_ms:.2f} ms a step longer than its peers before "
            f"{len(down.positions)} of its collectives where {trace.label(upstream)} computes on time, and rank "
            f"{upstream} {up.late_ms:.2f} ms before {len(up.positions)} where rank {downstream} does (median over "
            f"{steps} steps; from call times: gloo records no send or receive): the pipeline link between them "
            "delivers late"
        ),
        evidence={
            "upstream_late_ms": round(up.late_ms, 4),
            "downstream_late_ms": round(down.late_ms, 4),
            "upstream_positions": _positions(up),
            "downstream_positions": _positions(down),
            "upstream_z_needed": round(up.bar, 2),
            "downstream_z_needed": round(down.bar, 2),
            "steps": steps,
            "from_call_times": True,
        },
    )


def _positions(alone: Alone) -> dict[str, dict[str, float]]:
    """position -> the end's lateness there (ms), its z, and the z of its difference from the other end."""
    return {
        str(p): {
            "late_ms": round(late.ns / 1e6, 4),
            "z": round(min(late.z, 1e6), 1),
            "z_against_neighbour": round(min(d, 1e6), 1),
        }
        for p, late, d in zip(alone.positions, alone.lateness, alone.against_neighbour, strict=True)
    }
