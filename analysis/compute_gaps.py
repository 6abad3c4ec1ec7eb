"""Stragglers from GPU compute time: the share of the run each GPU spends outside NCCL.

Wait times inside one collective find a slow member only when it has peers doing the same work in
that collective (tensor parallelism). With TP=1 a slow GPU passes its delay down the pipeline and its
data-parallel peers meet it once a step, so the waits say little. GPU times say more: between the GPU
end of one NCCL operation and the GPU start of the next the GPU computes (on an asynchronous GPU the
host is ahead, so the stream is never idle waiting for it). Over a time window every rank shares, a
slow GPU computes a larger share of the time than its peers of the same pipeline stage (the ranks it
shares a collective communicator with, smaller than the world), whose extra time is spent waiting in
NCCL. When a stage has fewer than three ranks, all ranks are the reference. Only without tensor
parallelism: TP peers' waits are the better evidence there.

A rank's excess is the median over three sub-windows of its share against its reference's (a window
in which a busy host starved some GPUs is outvoted). The noise floor comes from the run: three times
the spread of the ranks' excess, at least 2.5%; and in two of the three sub-windows the rank must
compute more than its peers. A run whose floor exceeds 10% (a short or disturbed window) is not judged.
"""

from __future__ import annotations

from statistics import NormalDist

import numpy as np

from rankwatch.analysis.findings import Finding
from rankwatch.analysis.trace import P2P_OPS, Trace

WINDOWS = 3  # sub-windows of the shared time window, each judged on its own
MIN_EXCESS = 0.025  # a GPU computing less than 2.5% more than its peers is not reported ...
NOISE_FACTOR = 3.0  # ... nor one within this many times the run's own spread
MIN_AGREEING = 2  # sub-windows in which it must compute more than its reference
MIN_CALLS = 20  # GPU-timed calls a rank needs to be judged
MAX_FLOOR = 0.10  # a run whose ranks spread more than this around their peers is too noisy to judge


def _timed_calls(trace: Trace) -> dict[int, np.ndarray]:
    """rank -> (GPU start, GPU end) of its GPU-timed calls in GPU start order."""
    calls = trace.calls
    out = {}
    for rank in sorted(trace.ranks):
        own = calls[trace.rows_of(rank)]
        own = own[(own["gpu_start"] > 0) & (own["gpu_end"] >= own["gpu_start"])]
        if len(own) >= MIN_CALLS:
            order = np.argsort(own["gpu_start"], kind="stable")
            out[rank] = np.stack([own["gpu_start"][order], own["gpu_end"][order]]).astype(np.int64)
    return out


def _compute_shares(timed: dict[int, np.ndarray], edges: np.ndarray) -> np.ndarray:
    """[ranks, windows]: the share of each window a rank's GPU spent between NCCL operations."""
    shares = np.zeros((len(timed), len(edges) - 1))
    for i, spans in enumerate(timed.values()):
        busy_until = np.maximum.accumulate(spans[1][:-1])  # NCCL work on several streams may overlap
        next_start = spans[0][1:]
        for k in range(len(edges) - 1):
            lo, hi = edges[k], edges[k + 1]
            gap = np.clip(next_start, lo, hi) - np.clip(busy_until, lo, hi)
            shares[i, k] = np.maximum(gap, 0).sum() / (hi - lo)
    return shares


def stage_peers(trace: Trace) -> dict[int, set[int]]:
    """rank -> the ranks it shares a collective communicator with, smaller than the world (its
    tensor- and data-parallel peers: one pipeline stage), itself included."""
    world = len(trace.ranks)
    calls = trace.calls
    collective_comms = set(np.unique(calls["comm"][~np.isin(calls["op"], P2P_OPS)]).tolist())
    peers: dict[int, set[int]] = {rank: {rank} for rank in trace.ranks}
    for comm_id in collective_comms:
        comm = trace.comms.get(comm_id)
        if comm is None or not 2 <= comm.size < world:
            continue
        members = set(comm.members.values())
        for rank in members & peers.keys():
            peers[rank] |= members
    return peers


def without_tensor_parallelism(trace: Trace) -> bool:
    """True when most ranks have no collective peers doing the same work as often as they exchange with
    their pipeline partners: their busiest collective communicator holds only themselves, or is called
    less often than their sends and receives (data parallelism's once-a-step all-reduce). Tensor
    parallelism's all-reduces (several per layer) and pure data parallelism leave the waits inside
    those collectives as the better evidence (straggler.py): a GPU computing more there without
    delaying its peers is slack."""
    calls = trace.calls
    alone = judged = 0
    for rank in trace.ranks:
        rows = trace.rows_of(rank)
        p2p = np.isin(calls["op"][rows], P2P_OPS)
        own = calls["comm"][rows][~p2p]
        if not len(own):
            continue
        judged += 1
        comm_ids, counts = np.unique(own, return_counts=True)
        busiest = int(comm_ids[np.argmax(counts)])
        size = trace.comms[busiest].size if busiest in trace.comms else 1
        alone += size < 2 or int(counts.max()) < int(p2p.sum())
    return alone * 2 > judged


def detect_compute_stragglers(trace: Trace, explained: frozenset[int] = frozenset()) -> list[Finding]:
    """Ranks whose GPU computes a larger share of the run than their stage's peers (GPU-timed traces
    only); ``explained``: ranks another finding already accounts for (slow-link endpoints)."""
    if not without_tensor_parallelism(trace):
        return []
    timed = _timed_calls(trace)
    if len(timed) < 3:
        return []
    lo = max(int(spans[0][0]) for spans in timed.values())
    hi = min(int(spans[1].max()) for spans in timed.values())
    if hi - lo <= 0:
        return []
    ranks = list(timed)
    shares = _compute_shares(timed, np.linspace(lo, hi, WINDOWS + 1))
    total = shares.mean(axis=1)
    peers = stage_peers(trace)
    position = {rank: i for i, rank in enumerate(ranks)}
    reference = np.empty(len(ranks))
    per_window_reference = np.empty_like(shares)
    for i, rank in enumerate(ranks):
        group = [position[r] for r in peers.get(rank, {rank}) if r in position]
        group = group if len(group) >= 3 else list(range(len(ranks)))
        reference[i] = np.median(total[group])
        per_window_reference[i] = np.median(shares[group], axis=0)
    if not (reference > 0).all() or not (per_window_reference > 0).all():
        return []
    # the median of the sub-windows' excess: a window in which a busy host starved some GPUs is outvoted
    excess = np.median(shares / per_window_reference - 1, axis=1)
    noise = 1.4826 * float(np.median(np.abs(excess - np.median(excess))))
    # many ranks reach further into the noise's tail: the floor keeps the chance of one false rank ~1%
    tail = max(NOISE_FACTOR, NormalDist().inv_cdf(1 - 0.01 / len(ranks)))
    floor = max(MIN_EXCESS, tail * noise)
    if floor > MAX_FLOOR:
        return []
    agreeing = (shares > per_window_reference).sum(axis=1)
    flagged = [i for i in np.argsort(-excess) if excess[i] >= floor and agreeing[i] >= MIN_AGREEING]
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
                    f"{trace.label(rank)} computes {total[i]:.1%} of the time between its NCCL operations "
                    f"on its GPU vs {reference[i]:.1%} for its peers ({excess[i]:+.1%}, above the run's noise "
                    f"floor {floor:.1%}, in {int(agreeing[i])} of {WINDOWS} windows of {(hi - lo) / 1e9:.2f} s)"
                ),
                evidence={
                    "compute_share": round(float(total[i]), 4),
                    "peer_compute_share": round(float(reference[i]), 4),
                    "slowdown": round(float(excess[i]), 4),
                    "noise_floor": round(floor, 4),
                    "windows_agreeing": int(agreeing[i]),
                    "own_compute": True,
                    "communicator_size": len(peers.get(rank, {rank})),
                },
            )
        )
    return findings
