"""Straggler localisation from wait times inside each communicator.

In a collective every member leaves together, so the member that arrives last waits least: its
wait (return minus call time) is short while its peers' waits grow by its delay. Within one
instance (communicator, sequence number) the waits of the members are compared with each other,
which needs no clock alignment across nodes. Per rank and communicator the deficit is
``median(peer waits) - own wait``; a straggler has a deficit that is positive in most instances and
large against the spread of the communicator's waits (a median/MAD score). Communicators are scored
separately (TP peers do the same work; a pipeline stage is only compared with its own peers), and
a rank is reported once, with the communicator that shows it most clearly.
"""

from __future__ import annotations

import numpy as np

from rankwatch.analysis.findings import Finding, comm_label
from rankwatch.analysis.trace import COLLECTIVE_OPS, Trace

MIN_INSTANCES = 8


def _comm_waits(calls: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(ranks [size], waits [instances, size]) of complete instances, or None when too few."""
    ranks = np.unique(calls["rank"])
    if len(ranks) != size or size < 2:
        return None
    seqs, seq_index = np.unique(calls["seq"], return_inverse=True)
    rank_index = np.searchsorted(ranks, calls["rank"])
    waits = np.full((len(seqs), size), np.nan)
    waits[seq_index, rank_index] = (calls["t_return"] - calls["t_call"]).astype(np.float64)
    complete = ~np.isnan(waits).any(axis=1)
    if complete.sum() < MIN_INSTANCES:
        return None
    return ranks, waits[complete]


def detect_stragglers(trace: Trace, min_score: float = 4.0, min_share: float = 0.7) -> list[Finding]:
    calls = trace.calls
    done = calls[np.isin(calls["op"], COLLECTIVE_OPS) & (calls["t_return"] > 0)]
    best: dict[int, Finding] = {}
    for comm_id in np.unique(done["comm"]):
        comm = trace.comms.get(int(comm_id))
        mine = done[done["comm"] == comm_id]
        result = _comm_waits(mine, comm.size if comm else len(np.unique(mine["rank"])))
        if result is None:
            continue
        ranks, waits = result
        size = len(ranks)
        # deficit[i, r]: how much less rank r waited than its peers' median in instance i
        if size <= 16:
            peer_median = np.stack([np.median(np.delete(waits, r, axis=1), axis=1) for r in range(size)], axis=1)
        else:  # one member hardly moves the median of many: skip the per-member exclusion
            peer_median = np.repeat(np.median(waits, axis=1, keepdims=True), size, axis=1)
        deficit = peer_median - waits
        spread = np.median(np.abs(waits - np.median(waits, axis=1, keepdims=True)))
        scale = 1.4826 * spread + 1e3  # + 1 µs: a perfectly quiet communicator must not divide by zero
        typical = np.median(deficit, axis=0)
        score = typical / scale
        share = (deficit > 0).mean(axis=0) if size > 2 else (waits == waits.min(axis=1, keepdims=True)).mean(axis=0)
        for position in np.flatnonzero((score >= min_score) & (share >= min_share)):
            rank = int(ranks[position])
            confidence = float(min(1.0, share[position] * min(1.0, score[position] / (2 * min_score))))
            own_wait = float(np.median(waits[:, position]))
            peers_wait = float(np.median(peer_median[:, position]))
            finding = Finding(
                kind="straggler",
                ranks=[rank],
                nodes=[trace.node_of(rank)],
                communicator=comm_label(int(comm_id)),
                confidence=round(confidence, 3),
                summary=(
                    f"rank {rank} on node {trace.node_of(rank)} arrives last at the collectives of communicator "
                    f"{comm_label(int(comm_id))} ({size} ranks): it waits {own_wait / 1e6:.2f} ms vs its peers' "
                    f"{peers_wait / 1e6:.2f} ms (median over {len(waits)} collectives; last in "
                    f"{share[position]:.0%} of them)"
                ),
                evidence={
                    "own_wait_ms": round(own_wait / 1e6, 4),
                    "peer_wait_ms": round(peers_wait / 1e6, 4),
                    "delay_ms": round(float(typical[position]) / 1e6, 4),
                    "score": round(float(score[position]), 2),
                    "last_share": round(float(share[position]), 3),
                    "collectives": len(waits),
                    "communicator_size": size,
                },
            )
            if rank not in best or finding.confidence > best[rank].confidence:
                best[rank] = finding
    return list(best.values())
