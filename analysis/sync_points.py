"""Where a host stopped calling NCCL because it waits for its own GPU (a synchronisation point).

On an asynchronous GPU without GPU timing, a hang leaves every host blocked somewhere outside NCCL.
A rank whose host never made the next call stopped there; but a host blocked in a synchronisation (a
loss ``.item()``, a grad-norm) stopped because its GPU waits for someone, and call times cannot say
for whom. Such a stop falls where that host regularly blocked in the healthy steps before: after
the same run of calls (the same place in the step) the next call came late every time. A rank
stopped at such a place is not named as the one the job waits for.
"""

from __future__ import annotations

import numpy as np

from rankwatch.analysis.ring import Op
from rankwatch.analysis.slow_link import transfer_keys
from rankwatch.analysis.trace import P2P_OPS, Trace, is_p2p

CONTEXT_CALLS = 16  # the calls before the stop that identify its place in a step
MIN_EARLIER = 1  # earlier occurrences of that place needed to judge it
SYNC_GAP_RATIO = 20.0  # a synchronisation: the next call comes this many times later than usual ...
MIN_SYNC_GAP_NS = 200_000  # ... and at least this late


def _signatures(calls: np.ndarray) -> np.ndarray:
    """One integer per call for what it is (operation, communicator, peer), not which one (sequence)."""
    op = calls["op"].astype(np.uint64)
    comm = calls["comm"].astype(np.uint64)
    peer = calls["peer"].astype(np.int64).astype(np.uint64)
    return (comm * np.uint64(0x9E3779B97F4A7C15)) ^ (op * np.uint64(0xC2B2AE3D27D4EB4F)) ^ peer


def stopped_at_sync(trace: Trace, rank: int) -> bool:
    """True when ``rank``'s last call sits where its host regularly blocked after calling (its GPU
    is behind; the host waits in a synchronisation, not for lack of a call)."""
    own = trace.calls[trace.rows_of(rank)]
    if len(own) < CONTEXT_CALLS + MIN_EARLIER + 1:
        return False
    signatures = _signatures(own)
    gaps = np.diff(own["t_call"].astype(np.int64)).astype(np.float64)
    windows = np.lib.stride_tricks.sliding_window_view(signatures[:-1], CONTEXT_CALLS)
    last = signatures[-CONTEXT_CALLS:]
    # windows[j] ends at call j + CONTEXT_CALLS - 1, whose next call is known (the last call excluded)
    same = np.flatnonzero((windows == last).all(axis=1)) + CONTEXT_CALLS - 1
    if len(same) < MIN_EARLIER:
        return False
    usual = float(np.median(gaps))
    after = float(np.median(gaps[same]))
    return after >= max(MIN_SYNC_GAP_NS, SYNC_GAP_RATIO * usual)


def synchronised(trace: Trace, ranks: list[int]) -> set[int]:
    """Of ``ranks``, those stopped at a synchronisation point."""
    return {rank for rank in ranks if stopped_at_sync(trace, rank)}


def matched(trace: Trace) -> np.ndarray:
    """Per call: its counterparts were called (every member entered the collective's sequence number;
    the peer posted the matching receive or send). An unmatched call is something its GPU may wait on."""
    calls = trace.calls
    out = np.ones(len(calls), bool)
    p2p = is_p2p(calls["op"])
    collective = np.flatnonzero(~p2p)
    comm, seq = calls["comm"][collective], calls["seq"][collective]
    _, index, entered = np.unique(transfer_keys(comm, comm * 0, comm * 0, seq), return_inverse=True, return_counts=True)
    comm_ids, comm_index = np.unique(comm, return_inverse=True)
    sizes = np.array([trace.comms[int(c)].size if int(c) in trace.comms else 0 for c in comm_ids.tolist()])
    out[collective] = entered[index.reshape(-1)] >= sizes[comm_index.reshape(-1)]
    rows = np.flatnonzero(p2p)
    send = calls["op"][rows] == Op.SEND
    me, peer = calls["comm_rank"][rows], calls["peer"][rows]
    sender, receiver = np.where(send, me, peer), np.where(send, peer, me)
    key = transfer_keys(calls["comm"][rows], sender, receiver, calls["seq"][rows])
    sends, recvs = key[send], key[~send]
    out[rows[send]] = np.isin(sends, recvs)
    out[rows[~send]] = np.isin(recvs, sends)
    return out


def _passed_by_peers(trace: Trace, rank: int) -> bool:
    """The other members of ``rank``'s last collective blocked after it and then went on: it completed
    on every GPU, so a host synchronising on it was released too."""
    calls = trace.calls
    last = calls[trace.rows_of(rank)][-1]
    comm = trace.comms.get(int(last["comm"]))
    if comm is None or comm.size < 2 or int(last["op"]) in P2P_OPS:
        return False
    for member in set(comm.members.values()) - {rank}:
        own = calls[trace.rows_of(member)]
        at = np.flatnonzero((own["comm"] == comm.id) & (own["seq"] == last["seq"]))
        if len(at) != 1 or at[0] + 1 >= len(own):
            return False
        if int(own["t_call"][at[0] + 1] - own["t_call"][at[0]]) < MIN_SYNC_GAP_NS:
            return False
    return True


def not_culprits(trace: Trace, ranks: list[int]) -> set[int]:
    """Of ``ranks`` (ranks that stopped calling with others waiting for them), those whose stop call
    times do not pin on them: stopped at a synchronisation point, unless nothing it called is left
    unmatched and its peers were released from the same synchronisation (its host stopped by itself)."""
    synced = synchronised(trace, ranks)
    if not synced:
        return set()
    open_calls = ~matched(trace)
    return {rank for rank in synced if open_calls[trace.rows_of(rank)].any() or not _passed_by_peers(trace, rank)}
