"""Slow links: one sender -> receiver pair whose transfers take far longer than every other pair's.

The n-th Send a->b is matched with the n-th Recv b<-a of the same communicator (the ring's per-peer
sequence numbers). A transfer's own time is from the moment both sides had arrived until the first
side was released: ``min(returns) - max(calls)``, which excludes either side's lateness (that is a
straggler, not a link). Pairs are compared with each other by their median transfer time; a pair far
above the rest (median/MAD score and an absolute floor) is reported with both endpoints.
"""

from __future__ import annotations

import numpy as np

from rankwatch.analysis.findings import Finding, comm_label
from rankwatch.analysis.ring import Op
from rankwatch.analysis.trace import Trace

MIN_TRANSFERS = 5


def _global_peers(trace: Trace, calls: np.ndarray) -> np.ndarray:
    peers = np.full(len(calls), -1, np.int64)
    for comm_id in np.unique(calls["comm"]):
        comm = trace.comms.get(int(comm_id))
        if not comm:
            continue
        rows = np.flatnonzero(calls["comm"] == comm_id)
        lookup = np.full(max(comm.members) + 2 if comm.members else 1, -1, np.int64)
        for comm_rank, rank in comm.members.items():
            lookup[comm_rank] = rank
        local = calls["peer"][rows]
        valid = (local >= 0) & (local < len(lookup))
        peers[rows[valid]] = lookup[local[valid]]
    return peers


def _keys(comm: np.ndarray, sender: np.ndarray, receiver: np.ndarray, seq: np.ndarray) -> np.ndarray:
    hashed = comm.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    hashed ^= sender.astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
    hashed ^= receiver.astype(np.uint64) * np.uint64(0x165667B19E3779F9)
    return hashed ^ seq.astype(np.uint64)


def detect_slow_links(trace: Trace, min_score: float = 6.0, min_excess_ns: float = 200_000) -> list[Finding]:
    calls = trace.calls[trace.calls["t_return"] > 0]
    sends, recvs = calls[calls["op"] == Op.SEND], calls[calls["op"] == Op.RECV]
    if not len(sends) or not len(recvs):
        return []
    send_to, recv_from = _global_peers(trace, sends), _global_peers(trace, recvs)
    send_keys = _keys(sends["comm"], sends["rank"], send_to, sends["seq"])
    recv_keys = _keys(recvs["comm"], recv_from, recvs["rank"], recvs["seq"])
    _, s_index, r_index = np.intersect1d(send_keys, recv_keys, return_indices=True)
    if not len(s_index):
        return []
    s, r = sends[s_index], recvs[r_index]
    transfer = np.minimum(s["t_return"], r["t_return"]) - np.maximum(s["t_call"], r["t_call"])
    pairs = np.stack([s["rank"].astype(np.int64), r["rank"].astype(np.int64)], axis=1)
    unique_pairs, pair_index = np.unique(pairs, axis=0, return_inverse=True)
    pair_index = pair_index.reshape(-1)
    medians = np.full(len(unique_pairs), np.nan)
    counts = np.bincount(pair_index, minlength=len(unique_pairs))
    order = np.argsort(pair_index, kind="stable")
    for position, chunk in enumerate(np.split(transfer[order], np.cumsum(counts)[:-1])):
        if len(chunk) >= MIN_TRANSFERS:
            medians[position] = np.median(chunk)
    usable = ~np.isnan(medians)
    if usable.sum() < 3:
        return []  # nothing to compare a pair with
    typical = float(np.median(medians[usable]))
    spread = 1.4826 * float(np.median(np.abs(medians[usable] - typical))) + 1e3
    findings: dict[frozenset[int], Finding] = {}  # a link is both directions of one pair
    for position in np.flatnonzero(usable):
        excess = medians[position] - typical
        if excess < min_excess_ns or excess / spread < min_score:
            continue
        sender, receiver = (int(x) for x in unique_pairs[position])
        comm_id = int(s["comm"][pair_index == position][0])
        link = frozenset((sender, receiver))
        finding = Finding(
            kind="slow_link",
            ranks=[sender, receiver],
            nodes=sorted({trace.node_of(sender), trace.node_of(receiver)}),
            communicator=comm_label(comm_id),
            confidence=round(float(min(1.0, excess / spread / (2 * min_score))), 3),
            summary=(
                f"transfers from {trace.label(sender)} to {trace.label(receiver)} take "
                f"{medians[position] / 1e6:.2f} ms once both sides are ready, against {typical / 1e6:.2f} ms "
                f"for the other pairs (median over {int(counts[position])} transfers): the link between them"
            ),
            evidence={
                "median_transfer_ms": round(float(medians[position]) / 1e6, 4),
                "typical_transfer_ms": round(typical / 1e6, 4),
                "transfers": int(counts[position]),
                "pairs_compared": int(usable.sum()),
            },
        )
        if link not in findings or finding.confidence > findings[link].confidence:
            findings[link] = finding
    return list(findings.values())
