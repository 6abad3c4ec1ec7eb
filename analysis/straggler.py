"""Straggler localisation from wait times inside each communicator.

In a collective every member leaves together, so the member that arrives last waits least: its
wait (return minus call time) is short while its peers' waits grow by its delay. Within one
instance (communicator, sequence number) the waits of the members are compared with each other,
which needs no clock alignment across nodes. A straggler is the last arriver (least wait) in far
more instances than chance allows (binomial tail against 1/size), by a typical margin
(``median(peer waits) - own wait``) above a floor. Communicators are judged separately (TP peers do
the same work), and when many members of one communicator are "late" together that is the job's
structure (a pipeline stage reaching a world collective), not a fault. A rank is reported once,
with the communicator that shows it most clearly.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.recfunctions import repack_fields

from rankwatch.analysis.findings import Finding, comm_label
from rankwatch.analysis.trace import COLLECTIVE_OPS, P2P_OPS, Trace

MIN_INSTANCES = 8


def _comm_waits(calls: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(ranks [size], waits [instances, size]) of complete instances, or None when too few."""
    ranks = np.unique(calls["rank"])
    if len(ranks) != size or size < 2:
        return None
    seqs, seq_index = np.unique(calls["seq"], return_inverse=True)  # instances, in order
    rank_index = np.searchsorted(ranks, calls["rank"])
    waits = np.full((len(seqs), size), np.nan)
    waits[seq_index, rank_index] = (calls["t_return"] - calls["t_call"]).astype(np.float64)
    complete = ~np.isnan(waits).any(axis=1)
    if complete.sum() < MIN_INSTANCES:
        return None
    return ranks, waits[complete]


def _binomial_tail(successes: int, trials: int, p: float) -> float:
    """P(X >= successes) for X ~ Binomial(trials, p)."""
    return float(sum(math.comb(trials, k) * p**k * (1 - p) ** (trials - k) for k in range(successes, trials + 1)))


def detect_stragglers(
    trace: Trace,
    min_share: float = 0.5,
    max_p_value: float = 1e-4,
    min_delay_ns: float = 100_000,
    explained_by_links: frozenset[int] = frozenset(),
) -> list[Finding]:
    """``explained_by_links``: endpoints of slow links; lateness they pass on is not a straggler."""
    calls = trace.calls
    done = calls[np.isin(calls["op"], COLLECTIVE_OPS) & (calls["t_return"] > 0)]
    best: dict[int, Finding] = {}
    flagged_in: dict[int, set[int]] = {}  # rank -> communicators it was flagged in
    for comm_id in np.unique(done["comm"]):
        comm = trace.comms.get(int(comm_id))
        mine = done[done["comm"] == comm_id]
        result = _comm_waits(mine, comm.size if comm else len(np.unique(mine["rank"])))
        if result is None:
            continue
        ranks, waits = result
        instances, size = waits.shape
        if size <= 16:
            peer_median = np.stack([np.median(np.delete(waits, r, axis=1), axis=1) for r in range(size)], axis=1)
        else:  # one member hardly moves the median of many: skip the per-member exclusion
            peer_median = np.repeat(np.median(waits, axis=1, keepdims=True), size, axis=1)
        deficit = peer_median - waits  # how much less each member waited than its peers
        delay = np.median(deficit, axis=0)
        last = np.bincount(np.argmin(waits, axis=1), minlength=size)  # who arrived last, per instance
        share = last / instances
        flagged = [
            position
            for position in range(size)
            if share[position] >= min_share
            and delay[position] >= min_delay_ns
            and _binomial_tail(int(last[position]), instances, 1 / size) <= max_p_value
        ]
        if len(flagged) > max(1, size // 4):
            continue  # many members "late" together is the job's structure (e.g. a pipeline stage), not a fault
        spread = 1.4826 * np.median(np.abs(waits - np.median(waits, axis=1, keepdims=True))) + 1e3
        for position in flagged:
            rank = int(ranks[position])
            own_wait = float(np.median(waits[:, position]))
            peers_wait = float(np.median(peer_median[:, position]))
            confidence = float(share[position] * min(1.0, delay[position] / (4 * min_delay_ns)))
            finding = Finding(
                kind="straggler",
                ranks=[rank],
                nodes=[trace.node_of(rank)],
                communicator=comm_label(int(comm_id)),
                confidence=round(confidence, 3),
                summary=(
                    f"{trace.label(rank)} arrives last at the collectives of {trace.comm_name(int(comm_id))} "
                    f"({size} ranks): it waits {own_wait / 1e6:.2f} ms vs its peers' "
                    f"{peers_wait / 1e6:.2f} ms (median over {instances} collectives; last in "
                    f"{share[position]:.0%} of them)"
                ),
                evidence={
                    "own_wait_ms": round(own_wait / 1e6, 4),
                    "peer_wait_ms": round(peers_wait / 1e6, 4),
                    "delay_ms": round(float(delay[position]) / 1e6, 4),
                    "score": round(float(delay[position] / spread), 2),
                    "last_share": round(float(share[position]), 3),
                    "collectives": instances,
                    "communicator_size": size,
                },
            )
            flagged_in.setdefault(rank, set()).add(int(comm_id))
            if rank not in best or _strength(finding) > _strength(best[rank]):
                best[rank] = finding
    return [best[rank] for rank in _root_causes(trace, best, flagged_in, explained_by_links)]


def _strength(finding: Finding) -> tuple[int, float]:
    """Evidence from a larger communicator (more peers doing the same work) beats a pair."""
    return finding.evidence["communicator_size"], finding.confidence


def _root_causes(
    trace: Trace, best: dict[int, Finding], flagged_in: dict[int, set[int]], known_causes: frozenset[int]
) -> list[int]:
    """Drop ranks whose lateness another flagged rank explains.

    A late rank makes others late: its TP peers wait for it and then reach the next collective late
    too, and the pipeline stage that receives its activations starts late. So a flagged rank
    related to a stronger accepted (or already explained) one, or to a known cause such as a slow
    link's endpoint, is explained: related means within two hops of each other over send/receive
    partners and the members of communicators in which one of the two was flagged.
    """
    calls = trace.calls
    p2p = calls[np.isin(calls["op"], P2P_OPS)]
    partners: dict[int, set[int]] = {}
    for rank, comm_id, peer in np.unique(repack_fields(p2p[["rank", "comm", "peer"]])).tolist():
        comm = trace.comms.get(int(comm_id))
        other = comm.members.get(int(peer)) if comm else None
        if other is not None:
            partners.setdefault(int(rank), set()).add(other)
    members = {comm_id: set(comm.members.values()) for comm_id, comm in trace.comms.items()}

    neighbourhoods: dict[int, set[int]] = {}

    def neighbourhood(rank: int) -> set[int]:
        """Who a late ``rank`` delays: its partners, its peers where it was flagged, and their partners."""
        if rank not in neighbourhoods:
            near = {rank} | partners.get(rank, set())
            for comm_id in flagged_in.get(rank, ()):
                near |= members.get(comm_id, set())
            neighbourhoods[rank] = near.union(*(partners.get(other, set()) for other in near))
        return neighbourhoods[rank]

    def related(x: int, y: int) -> bool:
        return x in neighbourhood(y) or y in neighbourhood(x)

    explained: set[int] = set(known_causes)
    pending = [rank for rank in sorted(best, key=lambda r: _strength(best[r]), reverse=True) if rank not in explained]
    accepted: list[int] = []

    def explain_what_follows() -> None:
        changed = True
        while changed:
            changed = False
            for rank in list(pending):
                if any(related(rank, other) for other in (*accepted, *explained)):
                    pending.remove(rank)
                    explained.add(rank)
                    changed = True

    explain_what_follows()  # first what the known causes (slow links) explain
    while pending:
        accepted.append(pending.pop(0))
        explain_what_follows()
    return accepted
