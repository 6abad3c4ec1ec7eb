"""Stragglers of a synchronous backend (gloo on CPU) from call times, against the job's own spread.

Where a collective blocks its host until every member has joined (``Trace.calls_block_on_host``), no
GPU runs behind the host: a rank's call is made when its compute ended, and the collective ends when
its last member calls. So the time from the end of a rank's previous collective (its instance's
last call) to the rank's next call is what it computed, as GPU start and end times would say: the
call times give each collective a start (the rank's call) and an end (the instance's last call),
and the GPU-time analysis of compute_gaps.py runs on them unchanged: each gap of a step at its least
over the steps (a busy CPU, the wake-up of a rank that waited, only ever add), summed, against the
same sum of the rank's stage peers; the floor a rank must pass comes from the spread of every rank's
excess in the same job (z-score of the tail a job of this many ranks reaches by chance, at least
2.5%), and a named rank is at least ``MIN_HOST_SLOWDOWN`` slower. Where peers wait for a late rank
their wait lies inside the collective, not in their gaps.

But a rank waiting inside a send/receive that gloo's recorder leaves out has that wait in its gap:
the pipeline stage after a slow rank computes "longer" too. So a rank is named only when it alone
stands out: flagged ranks whose most-often-called communicator holds another flagged rank (a TP
group waiting on its receives together) are the lateness passed on, and of what is left exactly one
must remain; otherwise the problems say the slowdown is not localisable, with the numbers. A
slowdown that began mid-run hides under the least-over-steps of the steps before it, so the second
half of the run is judged too when the whole names nobody.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rankwatch.analysis.compute_gaps import MAX_FLOOR, StepExcess, step_excess
from rankwatch.analysis.findings import Finding
from rankwatch.analysis.instances import group_instances
from rankwatch.analysis.trace import COLLECTIVE_OPS, Trace

MIN_HOST_SLOWDOWN = 0.10
"""A host's compute is shared with whatever else runs on its CPU: a co-tenant holds one rank a few
percent back for a whole run (the real bench's healthy runs beside a CPU-bound process: +3.3%, far
beyond the ranks' spread). Below this a rank standing out is reported as not localisable, not named."""


def host_timed(trace: Trace, since_ns: int | None = None) -> Trace:
    """The trace with each collective's call as its start and its instance's last call as its end
    (where every member recorded the instance), as GPU times; calls before ``since_ns`` left out."""
    calls = trace.calls.copy()
    calls["gpu_start"] = 0
    calls["gpu_end"] = 0
    keep = np.isin(calls["op"], COLLECTIVE_OPS)
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
        calls = calls[(calls["t_call"] >= since_ns) | ~np.isin(calls["op"], COLLECTIVE_OPS)]
    return dataclasses.replace(trace, calls=calls, _bounds=None)


def _finest_peers(trace: Trace) -> dict[int, set[int]]:
    """rank -> the members of the collective communicator it calls most often (its TP group; its DP
    group when TP is 1)."""
    calls = trace.calls
    collective = np.isin(calls["op"], COLLECTIVE_OPS)
    ids, counts = np.unique(calls["comm"][collective], return_counts=True)
    best: dict[int, tuple[float, int]] = {}
    for comm_id, count in zip(ids.tolist(), counts.tolist(), strict=True):
        comm = trace.comms.get(comm_id)
        if comm is None or comm.size < 2:
            continue
        for rank in comm.members.values():
            key = (count / comm.size, -comm.size)
            if rank not in best or key > best[rank]:
                best[rank] = key
    peers: dict[int, set[int]] = {}
    for comm_id, count in zip(ids.tolist(), counts.tolist(), strict=True):
        comm = trace.comms.get(comm_id)
        if comm is None or comm.size < 2:
            continue
        for rank in comm.members.values():
            if best.get(rank) == (count / comm.size, -comm.size):
                peers.setdefault(rank, set()).update(comm.members.values())
    return peers


def detect_host_stragglers(trace: Trace, problems: list[str], since_ns: int | None = None) -> list[Finding]:
    """The one rank of a synchronous backend's job that computes longer than its peers (see the
    module); ``problems`` gets the numbers when ranks stand out but none alone."""
    measured = step_excess(host_timed(trace, since_ns))
    findings, notes = _judge(trace, measured, "")
    if not findings and measured is not None:
        times = trace.calls["t_call"][trace.calls["t_call"] > 0]
        middle = int(np.median(times)) if len(times) else None
        if middle is not None:
            later = step_excess(host_timed(trace, max(middle, since_ns or 0)))
            findings, later_notes = _judge(trace, later, " in the second half of the run")
            notes = notes or later_notes  # the whole run's numbers first: more steps
    if not findings:
        problems.extend(notes)
    return findings


def _judge(trace: Trace, measured: StepExcess | None, when: str) -> tuple[list[Finding], list[str]]:
    if measured is None:
        return [], []
    excess, floor = measured.excess, measured.floor
    judged = ~np.isnan(excess)
    noise = 1.4826 * float(np.median(np.abs(excess[judged] - np.median(excess[judged]))))
    order = [int(i) for i in np.argsort(-np.nan_to_num(excess, nan=-np.inf)) if judged[i]]

    def numbers(i: int) -> str:
        z = excess[i] / noise if noise > 0 else float("inf")
        return (
            f"rank {measured.ranks[i]} {measured.total_ms[i]:.2f} ms a step vs {measured.reference_ms[i]:.2f} ms, "
            f"{excess[i]:+.1%}, z {z:.1f}"
        )

    if floor > MAX_FLOOR:
        return [], [
            f"call times{when}: the ranks' compute a step spreads too widely to single one out (noise floor "
            f"{floor:.1%}, above {MAX_FLOOR:.0%}; most: {numbers(order[0])}): a slowdown is not localisable"
        ]
    below = [i for i in order if floor <= excess[i] < MIN_HOST_SLOWDOWN]
    flagged = {measured.ranks[i] for i in order if excess[i] >= max(floor, MIN_HOST_SLOWDOWN)}
    if not flagged and below:
        return [], [
            f"call times{when}: {numbers(below[0])} beyond the run's noise floor {floor:.1%} but under "
            f"{MIN_HOST_SLOWDOWN:.0%}, what a co-tenant on its CPU does: a slowdown is not localisable"
        ]
    finest = _finest_peers(trace)
    roots = [i for i in order if (r := measured.ranks[i]) in flagged and not _with_flagged_peer(r, finest, flagged)]
    if len(roots) == 1 and len(flagged) <= max(1, len(order) // 4):
        return [_finding(trace, measured, roots[0], noise, flagged, when)], []
    if flagged:
        shown = "; ".join([numbers(i) for i in order if measured.ranks[i] in flagged][:4])
        return [], [
            f"call times{when}: {len(flagged)} ranks compute longer than their peers beyond the run's noise floor "
            f"{floor:.1%} ({shown}), none alone (ranks waiting in unrecorded sends/receives look the same): "
            "a slowdown is not localisable"
        ]
    return [], []


def _with_flagged_peer(rank: int, finest: dict[int, set[int]], flagged: set[int]) -> bool:
    """Another flagged rank in its most-often-called communicator: waiting together, passed on."""
    return bool((finest.get(rank, set()) - {rank}) & flagged)


def _finding(trace: Trace, measured: StepExcess, i: int, noise: float, flagged: set[int], when: str) -> Finding:
    rank, excess, floor = measured.ranks[i], float(measured.excess[i]), measured.floor
    z = excess / noise if noise > 0 else None
    passed_on = sorted(flagged - {rank})
    return Finding(
        kind="straggler",
        ranks=[rank],
        nodes=[trace.node_of(rank)],
        communicator=None,
        confidence=round(float(min(1.0, excess / (2 * floor))), 3),
        summary=(
            f"{trace.label(rank)} computes {measured.total_ms[i]:.2f} ms a step between its collectives{when} vs "
            f"{measured.reference_ms[i]:.2f} ms for its peers ({excess:+.1%}; the run's noise floor {floor:.1%}"
            f"{f', z {z:.1f}' if z is not None else ''}; each gap at its least over {int(measured.steps[i])} steps, "
            "from call times of collectives that block their host)"
        ),
        evidence={
            "step_compute_ms": round(float(measured.total_ms[i]), 3),
            "peer_step_compute_ms": round(float(measured.reference_ms[i]), 3),
            "delay_ms": round(float(measured.total_ms[i] - measured.reference_ms[i]), 3),  # per step
            "slowdown": round(excess, 4),
            "noise_floor": round(floor, 4),
            "z": round(z, 2) if z is not None else None,
            "steps": int(measured.steps[i]),
            "passed_on_to": passed_on,
            "own_compute": True,
            "communicator_size": len(measured.peers.get(rank, {rank})),
            "second_half": bool(when),
        },
    )
