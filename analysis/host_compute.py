"""Stragglers of a synchronous backend (gloo on CPU) from call times, against the job's own spread.

Where a collective blocks its host until every member has joined (``Trace.calls_block_on_host``), no
GPU runs behind the host: a rank's call is made when its compute ended, and the collective ends when
its last member calls. So the time from the end of a rank's previous collective (its instance's
last call) to the rank's next call is what it computed, as GPU start and end times would say: the
call times give each collective a start (the rank's call) and an end (the instance's last call),
and the GPU-time analysis of compute_gaps.py runs on them: each gap of a step at its least over the
steps (a busy CPU, the wake-up of a rank that waited, only ever add), summed, against the same sum
of the rank's stage peers (of a stage of two, the other one). Where peers wait for a late rank their
wait lies inside the collective, not in their gaps.

A rank is named only when it stands out of the whole job, by tests whose thresholds come from the
job itself: its excess lies beyond the spread of every judged rank's excess (1.4826 x MAD) by
Student's t for that many ranks (the spread is measured from the same few ranks; one false rank in
about 500 healthy jobs), it computed longer than its peers in more steps than chance allows (sign
test, 5% over the ranks: a co-tenant that slows a rank for a while is not every step), and it is at
least ``MIN_HOST_SLOWDOWN`` slower. Every other rank beyond the spread must be its lateness passed
on: a rank waiting in a send/receive that gloo's recorder leaves out has that wait in its gap, so
the ranks of its own pipeline in other stages may stand out too, by less than it does. Otherwise
the problems say "not localisable" with the numbers (effect, z, steps, p, and the slowdown this
job's spread would let stand out), never "healthy". A slowdown that began mid-run hides under the
least-over-steps of the steps before it, so the second half of the run is judged too when the
whole names nobody.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from rankwatch.analysis.compute_gaps import MIN_STEPS, NOISE_FACTOR, StepExcess, step_excess
from rankwatch.analysis.findings import Finding
from rankwatch.analysis.instances import group_instances
from rankwatch.analysis.job_noise import FALSE_RANK_CHANCE, sign_tail, student_tail
from rankwatch.analysis.trace import Trace, is_collective

MIN_HOST_SLOWDOWN = 0.10
"""A host's compute is shared with whatever else runs on its CPU: a co-tenant holds one rank a few
percent back for a whole run (the real bench's healthy runs beside a CPU-bound process: +3.3%, far
beyond the ranks' spread). Below this a rank standing out is reported as not localisable, not named."""
SIGN_P = 0.05  # the chance that a healthy rank is longer in this many steps (divided by the ranks)


def host_timed(trace: Trace, since_ns: int | None = None) -> Trace:
    """The trace with each collective's call as its start and its instance's last call as its end
    (where every member recorded the instance), as GPU times; calls before ``since_ns`` left out."""
    calls = trace.calls.copy()
    calls["gpu_start"] = 0
    calls["gpu_end"] = 0
    keep = is_collective(calls["op"])
    if since_ns is not None:
        keep &= calls["t_call"] >= since_ns
    rows = np.flatnonzero(keep)
    instances = group_instances(calls["comm"][rows], calls["seq"][rows], rows)
    if len(instances):
        sizes = instances.sizes
        expected = np.array([trace.comms[int(c)].size if int(c) in trace.comms else 0 for c in instances.comm.tolist()])
        last = np.maximum.reduceat(calls["t_call"][instances.rows], instances.starts[:-1])
        whole = np.repeat(sizes == expected, sizes)
        ended = instances.rows[whole]
        calls["gpu_start"][ended] = calls["t_call"][ended]
        calls["gpu_end"][ended] = np.repeat(last, sizes)[whole]
    if since_ns is not None:
        calls = calls[(calls["t_call"] >= since_ns) | ~is_collective(calls["op"])]
    return dataclasses.replace(trace, calls=calls, _bounds=None)


def detect_host_stragglers(
    trace: Trace, problems: list[str], since_ns: int | None = None, explained: frozenset[int] = frozenset()
) -> list[Finding]:
    """The one rank of a synchronous backend's job that computes longer than its peers (see the
    module); ``problems`` gets the numbers when no rank can be named. ``explained``: the ends of slow
    links (host_link.py): their lateness, and what they pass on down their pipeline, is no straggler."""
    measured = step_excess(host_timed(trace, since_ns), min_stage=2)
    findings, notes = _judge(trace, measured, "", explained)
    if not findings and measured is not None:
        times = trace.calls["t_call"][trace.calls["t_call"] > 0]
        middle = int(np.median(times)) if len(times) else None
        if middle is not None:
            later = step_excess(host_timed(trace, max(middle, since_ns or 0)), min_stage=2)
            findings, later_notes = _judge(trace, later, " in the second half of the run", explained)
            notes = notes or later_notes  # the whole run's numbers first: more steps
    if not findings:
        problems.extend(notes)
    return findings


@dataclass(frozen=True)
class _Standing:
    """How far each judged rank stands out of the job: effect, its z against the spread of every rank,
    and the sign test over the steps."""

    order: list[int]  # indices into the measurement, most excess first
    median: float
    spread: float  # 1.4826 x MAD of every judged rank's excess
    tail: float  # the z a job of this many ranks reaches by chance about once in 500 jobs
    p_values: np.ndarray

    def z(self, excess: float) -> float:
        return (excess - self.median) / self.spread if self.spread > 0 else float("inf")


def _standing(measured: StepExcess) -> _Standing:
    excess = measured.excess
    judged = ~np.isnan(excess)
    median = float(np.median(excess[judged]))
    spread = 1.4826 * float(np.median(np.abs(excess[judged] - median)))
    tail = max(NOISE_FACTOR, student_tail(1 - FALSE_RANK_CHANCE / int(judged.sum()), int(judged.sum()) - 1))
    p_values = np.ones(len(excess))
    trials = measured.compared_steps > 0
    p_values[trials] = sign_tail(measured.longer_steps[trials], measured.compared_steps[trials])
    order = [int(i) for i in np.argsort(-np.nan_to_num(excess, nan=-np.inf)) if judged[i]]
    return _Standing(order, median, spread, tail, p_values)


def _judge(
    trace: Trace, measured: StepExcess | None, when: str, explained: frozenset[int] = frozenset()
) -> tuple[list[Finding], list[str]]:
    """Name the rank that stands out of the whole job (z beyond what this many ranks reach by chance,
    longer than its peers in more steps than chance allows, and at least MIN_HOST_SLOWDOWN) when every
    other rank that stands out is its lateness passed on; else say why nobody is named. Ranks that
    ``explained`` (slow links' ends) or their lateness passed on account for are left out."""
    if measured is None:
        return [], []
    stand = _standing(measured)
    excess, ranks = measured.excess, measured.ranks
    significance = SIGN_P / len(stand.order)
    if explained:
        ends = [i for i, rank in enumerate(ranks) if rank in explained]
        left = [
            i
            for i in stand.order
            if ranks[i] not in explained and not any(_passed_on(trace, measured, end, i, stand) for end in ends)
        ]
        if not [i for i in left if stand.z(excess[i]) >= stand.tail]:
            return [], []  # the links account for every rank that stands out
        stand = dataclasses.replace(stand, order=left)

    def numbers(i: int) -> str:
        return (
            f"rank {ranks[i]} {measured.total_ms[i]:.2f} ms a step vs {measured.reference_ms[i]:.2f} ms, "
            f"{excess[i]:+.1%}, z {stand.z(excess[i]):.1f}, longer in {measured.longer_steps[i]} of "
            f"{measured.compared_steps[i]} steps (p {stand.p_values[i]:.1g})"
        )

    def bar() -> str:
        return (
            f"naming a rank takes z >= {stand.tail:.1f} (the job's spread {stand.spread:.1%} over {len(stand.order)} "
            f"ranks), p <= {significance:.0e} and >= {MIN_HOST_SLOWDOWN:.0%}"
        )

    out = [i for i in stand.order if stand.z(excess[i]) >= stand.tail]
    consistent = [i for i in out if stand.p_values[i] <= significance]
    named = [i for i in consistent if excess[i] >= MIN_HOST_SLOWDOWN]
    top = stand.order[0]
    if not out:
        reach = stand.median + stand.tail * stand.spread  # the least slowdown this job's spread lets stand out
        if stand.z(excess[top]) >= NOISE_FACTOR or reach > MIN_HOST_SLOWDOWN:
            return [], [
                f"call times{when}: no rank stands out of the job (most: {numbers(top)}); a rank must be "
                f"{max(reach, MIN_HOST_SLOWDOWN):+.1%} slower to be named here ({bar()}): a slowdown is not localisable"
            ]
        return [], []
    if not named:
        why = "not in enough steps" if not consistent else "less than a co-tenant on its CPU causes"
        return [], [f"call times{when}: {numbers(out[0])} ({why}); {bar()}: a slowdown is not localisable"]
    root = max(named, key=lambda i: measured.total_ms[i] - measured.reference_ms[i])
    unexplained = [i for i in out if i != root and not _passed_on(trace, measured, root, i, stand, significance)]
    if unexplained:
        shown = "; ".join(numbers(i) for i in [root, *unexplained][:4])
        return [], [
            f"call times{when}: {len(unexplained) + 1} ranks stand out of the job ({shown}), none alone; {bar()}: "
            "a slowdown is not localisable"
        ]
    passed = {ranks[i] for i in out} - {ranks[root]}
    return [_finding(trace, measured, root, stand, significance, passed, when)], []


def _passed_on(
    trace: Trace, measured: StepExcess, root: int, other: int, stand: _Standing, significance: float = 0.0
) -> bool:
    """Whether ``other``'s excess can be ``root``'s lateness passed on: waiting in sends/receives that
    gloo's recorder leaves out. Only ranks of another pipeline stage wait for a rank in their gaps (its
    stage peers meet it inside recorded collectives), only those in its own pipeline when the layout is
    known, and never for longer than it is late itself: by more than the job's spread in all, or in
    more steps than chance allows (at ``significance``, a sign test step by step: what a rank waits
    for is part of what the late rank adds in that same step, and on a busy machine the job's spread
    hides a difference that every step shows)."""
    root_rank, rank = measured.ranks[root], measured.ranks[other]
    if rank in measured.peers.get(root_rank, {root_rank}):
        return False
    if trace.layout is not None:
        (_, root_dp, _), (_, dp, _) = trace.layout.coords(root_rank), trace.layout.coords(rank)
        if root_dp != dp:
            return False
    root_late = measured.total_ms[root] - measured.reference_ms[root]
    late = measured.total_ms[other] - measured.reference_ms[other]
    margin = stand.tail * stand.spread * measured.reference_ms[other]
    if late + margin <= root_late:
        return True
    if late >= root_late or not significance:
        return False
    paired = measured.paired_lateness(root_rank, rank)
    if paired is None:
        return False
    root_steps, steps = paired
    both = ~np.isnan(root_steps) & ~np.isnan(steps)
    later = int((root_steps[both] > steps[both]).sum())
    return bool(both.sum() >= MIN_STEPS and sign_tail(np.array([later]), np.array([both.sum()]))[0] <= significance)


def _finding(
    trace: Trace, measured: StepExcess, i: int, stand: _Standing, significance: float, passed: set[int], when: str
) -> Finding:
    rank, excess = measured.ranks[i], float(measured.excess[i])
    z, p_value = stand.z(excess), float(stand.p_values[i])
    longer, compared = int(measured.longer_steps[i]), int(measured.compared_steps[i])
    return Finding(
        kind="straggler",
        ranks=[rank],
        nodes=[trace.node_of(rank)],
        communicator=None,
        confidence=round(float(min(1.0, z / (2 * stand.tail))), 3),
        summary=(
            f"{trace.label(rank)} computes {measured.total_ms[i]:.2f} ms a step between its collectives{when} vs "
            f"{measured.reference_ms[i]:.2f} ms for its peers ({excess:+.1%}; z {z:.1f} against the spread of every "
            f"rank of the job, {stand.spread:.1%}, where {stand.tail:.1f} names a rank; longer in {longer} of "
            f"{compared} steps, p {p_value:.1g}; each gap at its least over {int(measured.steps[i])} steps, from call "
            "times of collectives that block their host)"
        ),
        evidence={
            "step_compute_ms": round(float(measured.total_ms[i]), 3),
            "peer_step_compute_ms": round(float(measured.reference_ms[i]), 3),
            "delay_ms": round(float(measured.total_ms[i] - measured.reference_ms[i]), 3),  # per step
            "slowdown": round(excess, 4),
            "job_spread": round(stand.spread, 4),
            "noise_floor": round(stand.median + stand.tail * stand.spread, 4),  # the excess z reaches the tail at
            "z": round(z, 2) if np.isfinite(z) else None,
            "z_needed": round(stand.tail, 2),
            "longer_steps": longer,
            "compared_steps": compared,
            "p_value": float(f"{p_value:.3g}"),
            "p_needed": float(f"{significance:.3g}"),
            "steps": int(measured.steps[i]),
            "passed_on_to": sorted(passed),
            "own_compute": True,
            "communicator_size": len(measured.peers.get(rank, {rank})),
            "second_half": bool(when),
        },
    )
