"""Slow links: one sender -> receiver pair whose transfers take far longer than every other pair's.

The n-th Send a->b is matched with the n-th Recv b<-a of the same communicator (the ring's per-peer
sequence numbers). A transfer's own time is from the moment both sides had arrived until the first
side was released, ``min(returns) - max(calls)`` on host clocks aligned across nodes (clocks.py);
it excludes either side's lateness (that is a straggler, not a link), and a grouped partner's other
transfers (which hold back only that side's return). Pairs are
compared with each other by their median transfer time; a pair far above the rest (median/MAD score
and an absolute floor) is reported with both endpoints.
"""

from __future__ import annotations

import numpy as np

from rankwatch.analysis.clocks import aligned, node_offsets
from rankwatch.analysis.findings import Finding, comm_label
from rankwatch.analysis.instances import grouped_median, grouped_quantile
from rankwatch.analysis.ring import Op
from rankwatch.analysis.trace import Trace

MIN_TRANSFERS = 5
MAX_CLOCK_ERROR_NS = 100_000  # what node clock alignment leaves


def transfer_keys(comm: np.ndarray, sender: np.ndarray, receiver: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """One 64-bit key per transfer: communicator, sender and receiver (ranks in it), sequence."""
    hashed = comm.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    hashed ^= sender.astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
    hashed ^= receiver.astype(np.uint64) * np.uint64(0x165667B19E3779F9)
    return hashed ^ seq.astype(np.uint64)


def _match(send_keys: np.ndarray, recv_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the sends and receives with equal keys (each key once on either side)."""
    keys = np.concatenate([send_keys, recv_keys])
    order = np.argsort(keys)
    ordered = keys[order]
    pair = np.flatnonzero(ordered[1:] == ordered[:-1])
    first, second = order[pair], order[pair + 1]
    is_send = first < len(send_keys)
    first, second = np.where(is_send, first, second), np.where(is_send, second, first)
    valid = (first < len(send_keys)) & (second >= len(send_keys))
    return first[valid], second[valid] - len(send_keys)


def _steadily_slow(
    transfer: np.ndarray, when: np.ndarray, pair_index: np.ndarray, pairs: int, typical: float, min_excess_ns: float
) -> np.ndarray:
    """Per pair, whether it is slow in most of its transfers and all through the run: its lower
    quartile above twice what most pairs reach in their slowest tenth (and ``min_excess_ns`` above
    the typical pair), and its median in each third of its transfers above that floor too. GPU
    times of a shared machine jitter and a busy moment slows some transfers of every pair; a slow
    link is slow in every one. ``when``: each transfer's time, to split a pair's transfers in thirds."""
    values = transfer.astype(np.float64)
    upper = float(np.nanmedian(grouped_quantile(values, pair_index, pairs, 0.9)))
    floor = max(2 * upper, typical + min_excess_ns)
    steady = grouped_quantile(values, pair_index, pairs, 0.25) >= floor
    order = np.lexsort((when, pair_index))
    bounds = np.searchsorted(pair_index[order], np.arange(pairs + 1))
    for pair in np.flatnonzero(steady):
        own = values[order[bounds[pair] : bounds[pair + 1]]]
        steady[pair] = all(np.median(part) >= floor for part in np.array_split(own, 3) if len(part))
    return steady


def detect_slow_links(
    trace: Trace, min_score: float = 6.0, min_excess_ns: float = 200_000, since_ns: int | None = None
) -> list[Finding]:
    """``since_ns``: only transfers entered from then on."""
    calls = trace.calls
    usable = (calls["t_return"] > 0) & ((calls["op"] == Op.SEND) | (calls["op"] == Op.RECV))
    if since_ns is not None:
        usable &= calls["t_call"] >= since_ns
    p2p = np.flatnonzero(usable)
    if not len(p2p):
        return []
    columns = {name: calls[name][p2p] for name in ("op", "comm", "comm_rank", "peer", "seq", "rank")}
    shift = aligned(trace, node_offsets(trace), columns["rank"])
    # GPU-timed calls are timed on the GPU: an asynchronous GPU's host returns before the transfer ran
    gpu = (calls["gpu_start"][p2p] > 0) & (calls["gpu_end"][p2p] > 0)
    t_call = np.where(gpu, calls["gpu_start"][p2p], calls["t_call"][p2p]) - shift
    t_return = np.where(gpu, calls["gpu_end"][p2p], calls["t_return"][p2p]) - shift
    send = columns["op"] == Op.SEND
    sends, recvs = np.flatnonzero(send), np.flatnonzero(~send)
    if not len(sends) or not len(recvs):
        return []
    comm, me, peer, seq = columns["comm"], columns["comm_rank"], columns["peer"], columns["seq"]
    # the n-th Send i->j of a communicator meets the n-th Recv j<-i: no global rank needed to match
    send_keys = transfer_keys(comm[sends], me[sends], peer[sends], seq[sends])
    recv_keys = transfer_keys(comm[recvs], peer[recvs], me[recvs], seq[recvs])
    s_index, r_index = _match(send_keys, recv_keys)
    if not len(s_index):
        return []
    s, r = sends[s_index], recvs[r_index]
    transfer = np.minimum(t_return[s], t_return[r]) - np.maximum(t_call[s], t_call[r])
    # Both sides inside the call at once, or the match is wrong (dumps that start at different points
    # number their sends and receives from different origins): such a pair tells nothing.
    overlapping = transfer > -MAX_CLOCK_ERROR_NS
    s, r, transfer = s[overlapping], r[overlapping], transfer[overlapping]
    gpu_timed = bool(len(s)) and bool(np.mean(gpu[s] & gpu[r]) >= 0.5)
    rank = columns["rank"]
    pair_key = rank[s].astype(np.int64) << 32 | rank[r].astype(np.int64)
    unique_keys, pair_index = np.unique(pair_key, return_inverse=True)
    unique_pairs = np.stack([unique_keys >> 32, unique_keys & 0xFFFFFFFF], axis=1)
    pair_index = pair_index.reshape(-1)
    medians = grouped_median(transfer.astype(np.float64), pair_index, len(unique_keys))
    counts = np.bincount(pair_index, minlength=len(unique_keys))
    medians[counts < MIN_TRANSFERS] = np.nan
    usable = ~np.isnan(medians)
    if usable.sum() < 3:
        return []  # nothing to compare a pair with
    typical = float(np.median(medians[usable]))
    spread = 1.4826 * float(np.median(np.abs(medians[usable] - typical))) + 1e3
    steady = None
    if gpu_timed:
        steady = _steadily_slow(transfer, t_call[s], pair_index, len(unique_keys), typical, min_excess_ns)
    findings: dict[frozenset[int], Finding] = {}  # a link is both directions of one pair
    for position in np.flatnonzero(usable):
        excess = medians[position] - typical
        if excess < min_excess_ns or excess / spread < min_score:
            continue
        if steady is not None and not steady[position]:
            continue  # a few slow transfers (a busy moment), not a slow link
        sender, receiver = (int(x) for x in unique_pairs[position])
        comm_id = int(comm[s[np.argmax(pair_index == position)]])
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
