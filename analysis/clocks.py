"""Per-node host clock offsets, from the moments collectives release their members.

Every member of a collective leaves it at the same instant, so on an instance the members' return
times differ only by their nodes' clock offsets (plus a few microseconds). The largest communicator
(the world, usually) spans the most nodes: each node's offset is the median, over its ranks and that
communicator's completed instances, of its return time minus the instance's median return time.
Needed wherever host times of two nodes are compared (a send on one, its receive on another).
"""

from __future__ import annotations

import numpy as np

from rankwatch.analysis.instances import grouped_median
from rankwatch.analysis.trace import Trace, is_collective


def node_offsets(trace: Trace) -> dict[str, float]:
    """node -> ns to subtract from its host times; nodes the estimate cannot reach get 0."""
    if not trace.comms or not trace.has_returns:
        return {}
    largest = max(trace.comms.values(), key=lambda comm: comm.size)
    calls = trace.calls
    rows = np.flatnonzero((calls["comm"] == largest.id) & (calls["t_return"] > 0))
    rows = rows[is_collective(calls["op"][rows])]
    if not len(rows):
        return {}
    # a collective ends together on every GPU; an asynchronous GPU's host returns long before
    ended = np.where(calls["gpu_end"][rows] > 0, calls["gpu_end"][rows], calls["t_return"][rows])
    seq, returned, rank = calls["seq"][rows], ended.astype(np.float64), calls["rank"][rows]
    instances, index, sizes = np.unique(seq, return_inverse=True, return_counts=True)
    complete = (sizes == largest.size)[index]
    if not complete.any():
        return {}
    seq_order = np.lexsort((returned, index))
    bounds = np.searchsorted(index[seq_order], np.arange(len(instances) + 1))
    middle = returned[seq_order][(bounds[:-1] + bounds[1:] - 1) // 2]
    late = (returned - middle[index])[complete]
    ranks, rank_index = np.unique(rank[complete], return_inverse=True)
    names, node_of_rank = np.unique([trace.node_of(int(r)) for r in ranks], return_inverse=True)
    medians = grouped_median(late, node_of_rank.reshape(-1)[rank_index.reshape(-1)], len(names))
    return {str(name): float(median) for name, median in zip(names.tolist(), medians.tolist(), strict=True)}


def aligned(trace: Trace, offsets: dict[str, float], ranks: np.ndarray) -> np.ndarray:
    """ns to subtract from the host times of ``ranks`` (one value per element)."""
    if not offsets:
        return np.zeros(len(ranks))
    present = np.bincount(ranks) if len(ranks) else np.zeros(0, np.int64)  # global ranks are small: no sort
    per_rank = np.zeros(len(present))
    for rank in np.flatnonzero(present).tolist():
        per_rank[rank] = offsets.get(trace.node_of(rank), 0.0)
    return per_rank[ranks]
