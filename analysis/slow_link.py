"""Slow links: one sender -> receiver pair whose transfers take far longer than every other pair's.

The n-th Send a->b is matched with the n-th Recv b<-a of the same communicator (the ring's per-peer
sequence numbers). A transfer's own time is from the moment both sides had arrived until the first
side was released, ``min(returns) - max(calls)`` on host clocks aligned across nodes (clocks.py);
it excludes either side's lateness (that is a straggler, not a link), and a grouped partner's other
transfers (which hold back only that side's return).

Pairs are compared by their median transfer time with the other pairs of their own kind (both ends
on one node, or on two: a transfer over the network takes longer than one inside a node by nature;
all pairs together when a kind has too few for one slow link to be a minority among them),
against the noise of that same job (job_noise.py): a pair is named when its excess over the kind's
typical pair stands out of the spread of those pairs (1.4826 x MAD) by the Student tail that so many
pairs reach by chance once in 500 jobs, and its transfers take at least twice the typical one (pairs
within a factor of two differ by placement, not by a fault). The one absolute floor is physical: an
excess within one tick of the timestamps' measured resolution is no measurement. A pair must also be
slow in most of its transfers and all through the run (``_steadily_slow``): a busy moment on a shared
machine's hosts or GPUs slows some transfers of every pair. The evidence holds z, the z needed, and
the spread.
"""

from __future__ import annotations

import numpy as np

from rankwatch.analysis.clocks import aligned, node_offsets
from rankwatch.analysis.findings import Finding, comm_label
from rankwatch.analysis.instances import GroupedValues, factorize
from rankwatch.analysis.job_noise import TICK_SAMPLE, chance_tail, clock_tick_ns, robust_spread
from rankwatch.analysis.ring import Op
from rankwatch.analysis.trace import Trace

MIN_TRANSFERS = 5
MIN_PAIRS_OF_A_KIND = 6  # three links (both directions): one slow link among them leaves their median alone
MAX_CLOCK_ERROR_NS = 100_000  # what node clock alignment leaves


def transfer_keys(comm: np.ndarray, sender: np.ndarray, receiver: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """One 64-bit key per transfer: communicator, sender and receiver (ranks in it), sequence."""
    hashed = comm.astype(np.uint64)  # in place, one temporary at a time: millions of keys at 16k ranks
    hashed *= np.uint64(0x9E3779B97F4A7C15)
    for column, factor in ((sender, 0xC2B2AE3D27D4EB4F), (receiver, 0x165667B19E3779F9)):
        term = column.astype(np.uint64)
        term *= np.uint64(factor)
        hashed ^= term
        del term
    hashed ^= seq.astype(np.uint64)
    return hashed


def _clock_tick(t_call: np.ndarray, t_return: np.ndarray, s: np.ndarray) -> int:
    """:func:`clock_tick_ns` of the matched sends' call then return times, without gathering millions
    of them when its first sample (the first calls) already tells a nanosecond clock."""
    sample = t_call[s[:TICK_SAMPLE]].astype(np.int64)
    if len(s) >= TICK_SAMPLE and (sample > 0).any() and clock_tick_ns(sample) == 1:
        return 1
    return clock_tick_ns(np.concatenate([t_call[s], t_return[s]]).astype(np.int64))


MATCH_BLOCK = 1 << 20


def _match(keys: np.ndarray, sends: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the sends and receives with equal keys (each key once on either side), in the sends'
    order; ``keys``: the sends' then the receives'. One plain sort of the keys' high bits packed with
    each one's index (several times faster than an argsort of millions); the few whose high bits
    collide are told apart by their whole keys."""
    n = len(keys)
    index_bits = max(n.bit_length(), 1)
    if index_bits > 32:
        return _by_send(*_match_by_argsort(keys, sends))
    low = np.uint64((1 << index_bits) - 1)
    packed = keys * np.uint64(0x9E3779B97F4A7C15)  # one-to-one, and the sequence (low bits) into the high ones
    packed &= ~low
    for start in range(0, n, MATCH_BLOCK):  # each one's index, without an index array of millions
        packed[start : start + MATCH_BLOCK] |= np.arange(start, min(n, start + MATCH_BLOCK), dtype=np.uint64)
    packed.sort()
    order = (packed & low).view(np.int64)
    packed >>= np.uint64(index_bits)  # the high bits alone
    same = packed[1:] == packed[:-1]
    del packed
    crowded = np.zeros(n, bool)  # three or more with the same high bits: a collision, resolved below
    crowded[1:-1] = same[1:] & same[:-1]
    crowded[:-1] |= crowded[1:] & same
    crowded[1:] |= crowded[:-1] & same
    pair = np.flatnonzero(same & ~crowded[:-1])
    first, second = order[pair], order[pair + 1]  # the same high bits: the whole keys are compared last
    del pair, same
    if crowded.any():
        few = order[crowded]
        few_keys = keys[few]
        by_key = np.argsort(few_keys, kind="stable")
        few, few_keys = few[by_key], few_keys[by_key]
        equal = few_keys[1:] == few_keys[:-1]
        if (equal[1:] & equal[:-1]).any():  # a key three times: its sends and receives paired in order
            return _by_send(*_match_by_argsort(keys, sends))
        twin = np.flatnonzero(equal)
        first, second = np.r_[first, few[twin]], np.r_[second, few[twin + 1]]
    is_send = first < sends
    first, second = np.where(is_send, first, second), np.where(is_send, second, first)
    valid = (first < sends) & (second >= sends)
    send_index, recv_index = _by_send(first[valid], second[valid] - sends)
    whole = keys[send_index] == keys[recv_index + sends]  # in the sends' order: gathers that run ahead
    return send_index[whole], recv_index[whole]


def _match_by_argsort(keys: np.ndarray, sends: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_match` by a stable argsort of the whole keys: where a key comes three times or more, its
    k-th send meets its k-th receive, and no send or receive is used twice (an unstable sort's order of
    equal keys changes with numpy's version)."""
    order = np.argsort(keys, kind="stable")  # equal keys in trace order: their sends before their receives
    sorted_keys = keys[order]
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    del sorted_keys
    run = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(keys)]))
    run_sends = np.add.reduceat((order < sends).astype(np.int64), starts)
    nth_receive = np.arange(len(keys)) - starts[run] - run_sends[run]  # negative for the run's sends
    paired = (nth_receive >= 0) & (nth_receive < run_sends[run])
    send_index = order[starts[run[paired]] + nth_receive[paired]]
    return send_index, order[paired] - sends


def _by_send(send_index: np.ndarray, recv_index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The matched pairs in the sends' order (trace order: by rank, then time), by one sort of both
    packed into one integer."""
    if not len(send_index) or max(int(send_index.max()), int(recv_index.max())) >= 1 << 31:
        order = np.argsort(send_index, kind="stable")
        return send_index[order], recv_index[order]
    packed = send_index.astype(np.int64) << 32
    packed |= recv_index
    packed.sort()
    recv = packed & 0xFFFFFFFF
    packed >>= 32
    return packed, recv


def _steadily_slow(
    transfer: GroupedValues,
    values: np.ndarray,
    when: np.ndarray,
    key: np.ndarray,
    pair_index: np.ndarray,
    typical: np.ndarray,
    min_excess_ns: float,
) -> np.ndarray:
    """Per pair, whether it is slow in most of its transfers and all through the run: its lower
    quartile above twice what most pairs reach in their slowest tenth (and ``min_excess_ns`` above
    the typical pair), and its median in each third of its transfers above that floor too. Times
    of a shared machine jitter and a busy moment slows some transfers of every pair; a slow
    link is slow in every one. ``transfer``: the transfer times grouped by pair; ``values``, ``when``,
    ``key``, ``pair_index``: each transfer's time, when it was entered (to split a pair's transfers in
    thirds; ties by its key), its key and its pair; ``typical``: per pair, the typical pair of its kind."""
    upper = float(np.nanmedian(transfer.quantile(0.9)))
    floor = np.maximum(2 * upper, typical + min_excess_ns)
    steady = transfer.quantile(0.25) >= floor
    rows = np.flatnonzero(steady[pair_index])  # the few steady pairs' transfers, not every one
    order = rows[np.lexsort((key[rows], when[rows], pair_index[rows]))]
    bounds = np.searchsorted(pair_index[order], np.arange(len(steady) + 1))
    for pair in np.flatnonzero(steady):
        own = values[order[bounds[pair] : bounds[pair + 1]]]
        steady[pair] = all(np.median(part) >= floor[pair] for part in np.array_split(own, 3) if len(part))
    return steady


def detect_slow_links(
    trace: Trace, min_score: float | None = None, min_excess_ns: float | None = None, since_ns: int | None = None
) -> list[Finding]:
    """``min_score``: the z a pair must reach (default: the chance tail for the pairs compared);
    ``min_excess_ns``: the least excess that is a measurement (default: one tick of the timestamps'
    resolution); ``since_ns``: only transfers entered from then on."""
    calls = trace.calls
    usable = (calls["t_return"] > 0) & ((calls["op"] == Op.SEND) | (calls["op"] == Op.RECV))
    if since_ns is not None:
        usable &= calls["t_call"] >= since_ns
    p2p = np.flatnonzero(usable)
    if not len(p2p):
        return []
    columns = {name: calls[name][p2p] for name in ("op", "comm", "comm_rank", "peer", "seq", "rank")}
    send = columns.pop("op") == Op.SEND
    sends, recvs = np.flatnonzero(send), np.flatnonzero(~send)
    del send
    if not len(sends) or not len(recvs):
        return []
    comm, me, peer, seq = columns["comm"], columns["comm_rank"], columns["peer"], columns["seq"]
    # the n-th Send i->j of a communicator meets the n-th Recv j<-i: no global rank needed to match
    keys = np.empty(len(sends) + len(recvs), np.uint64)
    keys[: len(sends)] = transfer_keys(comm[sends], me[sends], peer[sends], seq[sends])
    keys[len(sends) :] = transfer_keys(comm[recvs], peer[recvs], me[recvs], seq[recvs])
    del me, peer, seq, columns["comm_rank"], columns["peer"], columns["seq"]
    s_index, r_index = _match(keys, len(sends))
    # each transfer's key: the order they were once compared in, which ties between them still follow
    transfer_key = keys[s_index]
    del keys
    if not len(s_index):
        return []
    s, r = sends[s_index], recvs[r_index]
    del sends, recvs, s_index, r_index
    # the times once the keys' columns are gone (memory: at 16k ranks each of these is 100s of MB)
    shift = aligned(trace, node_offsets(trace), columns["rank"])
    # GPU-timed calls are timed on the GPU: an asynchronous GPU's host returns before the transfer ran
    gpu = (calls["gpu_start"][p2p] > 0) & (calls["gpu_end"][p2p] > 0)
    t_call, t_return = calls["t_call"][p2p], calls["t_return"][p2p]
    if gpu.any():
        t_call[gpu], t_return[gpu] = calls["gpu_start"][p2p[gpu]], calls["gpu_end"][p2p[gpu]]
    del p2p, gpu
    t_call = t_call - shift  # float: the clock offsets are medians; one column at a time
    t_return = t_return - shift
    del shift
    transfer = t_return[s]  # min(returns) - max(calls), a column at a time (memory)
    np.minimum(transfer, t_return[r], out=transfer)
    entered = t_call[s]
    np.maximum(entered, t_call[r], out=entered)
    transfer -= entered
    del entered
    # Both sides inside the call at once, or the match is wrong (dumps that start at different points
    # number their sends and receives from different origins): such a pair tells nothing.
    overlapping = transfer > -MAX_CLOCK_ERROR_NS
    s, r, transfer = s[overlapping], r[overlapping], transfer[overlapping]
    transfer_key = transfer_key[overlapping]
    rank = columns["rank"]
    pair_key = rank[s].astype(np.int64) << 32 | rank[r].astype(np.int64)
    # in the sends' order a rank's transfers to one peer come in runs: no sort of every one
    unique_keys, pair_index = factorize(pair_key)
    del pair_key
    unique_pairs = np.stack([unique_keys >> 32, unique_keys & 0xFFFFFFFF], axis=1)
    values = transfer.astype(np.float64)
    grouped = GroupedValues(values, pair_index, len(unique_keys))
    medians = grouped.median()
    counts = np.bincount(pair_index, minlength=len(unique_keys))
    medians[counts < MIN_TRANSFERS] = np.nan
    usable = ~np.isnan(medians)
    if usable.sum() < 3:
        return []  # nothing to compare a pair with
    if min_excess_ns is None:
        min_excess_ns = float(_clock_tick(t_call, t_return, s))
    ranks = np.unique(unique_pairs)  # each rank's node once, not once per pair it is in
    _, node_index = np.unique([trace.node_of(rank) for rank in ranks.tolist()], return_inverse=True)
    node_of_pair = node_index.reshape(-1)[np.searchsorted(ranks, unique_pairs)]
    across = node_of_pair[:, 0] != node_of_pair[:, 1]
    kinds = {kind: usable & (across == kind) for kind in (False, True)}
    if any(0 < int(pairs.sum()) < MIN_PAIRS_OF_A_KIND for pairs in kinds.values()):
        kinds = {False: usable}  # too few of one kind for one slow link to be a minority: all together
    typical_of = np.zeros(len(unique_keys))
    spread_of = np.zeros(len(unique_keys))
    tail_of = np.full(len(unique_keys), np.inf)
    compared_of = np.zeros(len(unique_keys), np.int64)
    for pairs in kinds.values():
        if pairs.sum():
            compared_of[pairs] = int(pairs.sum())
            typical_of[pairs] = float(np.median(medians[pairs]))
            spread_of[pairs] = robust_spread(medians[pairs]) + min_excess_ns
            tail_of[pairs] = min_score if min_score is not None else chance_tail(int(pairs.sum()))
    # a busy moment (a shared machine's CPU or GPU) slows some transfers of every pair; a slow link, all
    steady = _steadily_slow(grouped, values, t_call[s], transfer_key, pair_index, typical_of, min_excess_ns)
    findings: dict[frozenset[int], Finding] = {}  # a link is both directions of one pair
    for position in np.flatnonzero(usable):
        typical, spread, tail = typical_of[position], spread_of[position], tail_of[position]
        excess = medians[position] - typical
        z = excess / spread
        if excess < max(min_excess_ns, typical) or z < tail:
            continue
        if not steady[position]:
            continue  # a few slow transfers (a busy moment), not a slow link
        sender, receiver = (int(x) for x in unique_pairs[position])
        own = np.flatnonzero(pair_index == position)
        comm_id = int(comm[s[own[np.argmin(transfer_key[own])]]])  # of its transfer of the lowest key
        link = frozenset((sender, receiver))
        finding = Finding(
            kind="slow_link",
            ranks=[sender, receiver],
            nodes=sorted({trace.node_of(sender), trace.node_of(receiver)}),
            communicator=comm_label(comm_id),
            confidence=round(float(min(1.0, z / (2 * tail))), 3),
            summary=(
                f"transfers from {trace.label(sender)} to {trace.label(receiver)} take "
                f"{medians[position] / 1e6:.2f} ms once both sides are ready, against {typical / 1e6:.2f} ms "
                f"for the other pairs (median over {int(counts[position])} transfers): the link between them"
            ),
            evidence={
                "median_transfer_ms": round(float(medians[position]) / 1e6, 4),
                "typical_transfer_ms": round(float(typical) / 1e6, 4),
                "transfers": int(counts[position]),
                "pairs_compared": int(compared_of[position]),
                "across_nodes": bool(across[position]),
                "pair_spread_ms": round(float(spread) / 1e6, 4),  # 1.4826 x MAD of those pairs' medians
                "z": round(float(z), 1),
                "z_needed": round(float(tail), 2),
            },
        )
        if link not in findings or finding.confidence > findings[link].confidence:
            findings[link] = finding
    return list(findings.values())
