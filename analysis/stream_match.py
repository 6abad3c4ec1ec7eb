"""Communicators of Megatrace's early logs, which name none: matching one rank's streams to another's.

The early format (``... stream <ptr> opCount <n>``, no ``groupHash``) tells a rank's communicators
apart by the stream each runs on, but a stream address means nothing on another rank. Members of one
communicator share its opCount sequence (NCCL counts per communicator, from 0 on every member): at each
opCount they call the same operation with the same element count, at nearly the same time. So two
streams of two ranks are one communicator when, over the opCounts both logged, the operations agree
(at least ``MIN_AGREEMENT``) and their call times lie closer than each stream does to any other stream
of the other rank. Pairs are joined closest first, never two streams of one rank into one communicator.
Streams whose opCount never moves (communicators of one rank, which NCCL does not count) stay alone.
Pipeline stages that do the same work at nearly the same time look alike; with the Megatron layout a
matched set that is not a whole group of the layout (some of the group's other ranks logged their own
stream for it) is split into the groups that are.
"""

from __future__ import annotations

import zlib
from itertools import combinations

import numpy as np

from rankwatch.analysis.ring import Op
from rankwatch.analysis.topology import Layout
from rankwatch.analysis.trace import Communicator

MIN_COMMON = 8  # opCounts both streams logged
MIN_AGREEMENT = 0.9  # share of them with the same operation and count
MAX_SKEW_NS = 2_000_000_000  # a member later than this at most opCounts is another communicator
MAX_RANKS = 512  # pairwise matching beyond this is too slow to be worth it


def _streams(calls: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    """(rank, stream comm id) -> its collective calls sorted by opCount (first call of each opCount)."""
    collective = ~np.isin(calls["op"], (Op.SEND, Op.RECV))
    out = {}
    rows = np.flatnonzero(collective)
    keys = np.stack([calls["rank"][rows].astype(np.int64), calls["comm"][rows].astype(np.int64)], axis=1)
    order = np.lexsort((calls["t_call"][rows], calls["seq"][rows], keys[:, 1], keys[:, 0]))
    rows, keys = rows[order], keys[order]
    if not len(rows):
        return out
    new = np.r_[True, (keys[1:] != keys[:-1]).any(axis=1)]
    bounds = np.r_[np.flatnonzero(new), len(rows)]
    for start, stop in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        mine = calls[rows[start:stop]]
        first = np.r_[True, mine["seq"][1:] != mine["seq"][:-1]]
        mine = mine[first]
        if len(mine) >= MIN_COMMON and mine["seq"][0] != mine["seq"][-1]:
            out[(int(mine["rank"][0]), int(mine["comm"][0]))] = mine
    return out


def _score(a: np.ndarray, b: np.ndarray) -> float | None:
    """Median call-time distance at the opCounts both logged, or None when they are not one communicator."""
    common, ia, ib = np.intersect1d(a["seq"], b["seq"], assume_unique=True, return_indices=True)
    if len(common) < MIN_COMMON:
        return None
    same = (a["op"][ia] == b["op"][ib]) & (a["count"][ia] == b["count"][ib])
    if same.mean() < MIN_AGREEMENT:
        return None
    skew = float(np.median(np.abs(a["t_call"][ia] - b["t_call"][ib]).astype(np.float64)))
    return skew if skew <= MAX_SKEW_NS else None


def _layout_parts(ranks: set[int], logged: set[int], layout: Layout) -> list[set[int]]:
    """``ranks`` split into whole groups of the layout: along as many of the axes they vary on as
    leave every part holding all the logged ranks of its group."""
    coords = {rank: layout.coords(rank) for rank in ranks}
    varying = [axis for axis in range(3) if len({c[axis] for c in coords.values()}) > 1]
    for size in range(len(varying), 0, -1):
        for axes in combinations(varying, size):
            fixed = [axis for axis in range(3) if axis not in axes]
            parts: dict[tuple[int, ...], set[int]] = {}
            for rank, c in coords.items():
                parts.setdefault(tuple(c[a] for a in fixed), set()).add(rank)
            whole = all(
                {r for r in logged if all(layout.coords(r)[a] == key[i] for i, a in enumerate(fixed))} <= part
                for key, part in parts.items()
            )
            if whole:
                return list(parts.values())
    return [{rank} for rank in ranks]


def match_streams(
    calls: np.ndarray, layout: Layout | None = None
) -> tuple[dict[int, int], dict[int, Communicator], str | None]:
    """(stream comm id -> communicator id, communicators, a problem to report or None)."""
    streams = _streams(calls)
    ranks = sorted({rank for rank, _ in streams})
    if len(ranks) > MAX_RANKS:
        return {}, {}, f"{len(ranks)} ranks: communicators of logs without groupHash are not matched beyond {MAX_RANKS}"
    by_rank: dict[int, list[int]] = {}
    for rank, comm in streams:
        by_rank.setdefault(rank, []).append(comm)
    edges = []
    for i, r in enumerate(ranks):
        for r2 in ranks[i + 1 :]:
            scores = {
                (a, b): s
                for a in by_rank[r]
                for b in by_rank[r2]
                if (s := _score(streams[(r, a)], streams[(r2, b)])) is not None
            }
            for (a, b), s in scores.items():  # mutual best: closer than to any other stream of the other rank
                if all(s <= t for (x, y), t in scores.items() if x == a or y == b):
                    edges.append((s, (r, a), (r2, b)))
    parent: dict[tuple[int, int], tuple[int, int]] = {node: node for node in streams}
    ranks_in: dict[tuple[int, int], set[int]] = {node: {node[0]} for node in streams}

    def root(node: tuple[int, int]) -> tuple[int, int]:
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for _, x, y in sorted(edges):
        rx, ry = root(x), root(y)
        if rx != ry and not ranks_in[rx] & ranks_in[ry]:
            parent[ry] = rx
            ranks_in[rx] |= ranks_in.pop(ry)
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for node in streams:
        groups.setdefault(root(node), []).append(node)
    mapping: dict[int, int] = {}
    comms: dict[int, Communicator] = {}
    logged = set(ranks)
    pieces = []
    for members in groups.values():
        if layout is None or len(members) < 2:
            pieces.append(members)
            continue
        by_rank_of = dict(members)
        parts = _layout_parts(set(by_rank_of), logged, layout)
        pieces += [[(rank, by_rank_of[rank]) for rank in part] for part in parts]
    for members in pieces:
        if len(members) < 2:
            continue
        members.sort()
        comm_id = zlib.crc32(repr(members).encode()) | (1 << 41)
        comms[comm_id] = Communicator(comm_id, len(members), {i: rank for i, (rank, _) in enumerate(members)})
        for _, stream in members:
            mapping[stream] = comm_id
    return mapping, comms, None
