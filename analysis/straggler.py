"""Straggler localisation from wait times inside each communicator.

In a collective every member leaves together, so the member that arrives last waits least: its
wait is short while its peers' waits grow by its delay. Within one instance (communicator, sequence
number) the members' waits are compared with each other, which needs no clock alignment across
nodes. The wait is the GPU time of the call when it was timed (on a real GPU the host call returns
at once), else return minus call time. Sources with call times only (Megatrace) use arrival times:
a member's "wait" is the last arrival minus its own, after removing each node's clock offset
(estimated as the median lateness of the node's ranks, which one slow rank does not move).

A straggler waits less than its peers' median in far more instances than chance allows (sign test,
p = 1/2), is the last to arrive well above chance, and its typical margin (``median(peer waits) -
own wait``) stands out of the noise measured in the same instances: its z (the margin over the
standard error of its median, from the spread of the margins instance by instance) passes the
Student tail that a job of this many ranks reaches by chance once in 500 jobs (job_noise.py). A
margin within one tick of the timestamps' measured resolution is no measurement (a clock that keeps
microseconds cannot show a 5 us delay), and one below 3% of the compute between calls is not worth a
cordon; a margin above both that the noise still covers is told as not localisable, with its numbers.
Communicators are judged separately (TP peers do the same work); when many members of one are
"late" together that is the job's structure (a pipeline stage reaching a world collective), not a
fault. A rank is reported once, with the communicator that shows it most clearly. All
communicators of one size are scored together as ``[instances, members]`` arrays: a 16k-rank trace is
a few array passes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from rankwatch.analysis.compute_gaps import MIN_EXCESS
from rankwatch.analysis.findings import Finding, comm_label
from rankwatch.analysis.instances import Instances, factorize, grouped_median, instances_of
from rankwatch.analysis.job_noise import chance_tail, clock_tick_at, median_standard_error, sign_tail
from rankwatch.analysis.trace import Trace, durations, is_collective, is_p2p

MIN_INSTANCES = 8
RELATIVE_DELAY = 0.03  # nobody would act on a delay below 3% of the compute between calls


@dataclass(frozen=True)
class _Candidate:
    comm: int
    ranks: np.ndarray  # the communicator's members, ascending
    waits: np.ndarray  # [instances, members]
    rows: np.ndarray  # [instances, members] rows into the calls
    position: int
    last_share: float


def _waits(trace: Trace, rows: np.ndarray) -> np.ndarray:
    """Per row, the time inside the call (computed in trace order, then gathered once: gathers from
    the wide call records are what costs at 16k ranks)."""
    return durations(trace.calls)[rows].astype(np.float64)


def _arrival_waits(trace: Trace, instances: Instances, complete: np.ndarray) -> np.ndarray:
    """Per row of ``instances.rows``: the instance's last aligned arrival minus the row's own."""
    calls = trace.calls
    rows = instances.rows
    t = calls["t_call"][rows].astype(np.float64)
    instance_of = np.repeat(np.arange(len(instances)), instances.sizes)
    rank = calls["rank"][rows]
    n_ranks = int(rank.max()) + 1
    node_names = [trace.node_of(r) for r in range(n_ranks)]
    if "unknown" not in node_names:  # else clocks are taken as aligned, as Megatrace does
        node_of_rank = np.unique(node_names, return_inverse=True)[1].reshape(-1)
        offset = np.zeros(node_of_rank.max() + 1)
        usable = complete[instance_of]
        for _ in range(2):  # lateness against the instance median, per rank, then per node
            aligned = t - offset[node_of_rank[rank]]
            late = aligned - _segment_median(aligned, instances.starts)[instance_of]
            per_rank = grouped_median(late[usable], rank[usable], n_ranks)
            seen = np.flatnonzero(np.isfinite(per_rank))
            offset += np.nan_to_num(grouped_median(per_rank[seen], node_of_rank[seen], len(offset)))
        t = t - offset[node_of_rank[rank]]
    last = np.maximum.reduceat(t, instances.starts[:-1])
    return last[instance_of] - t


def _segment_median(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    sizes = np.diff(starts)
    out = np.empty(len(sizes))
    for size in np.unique(sizes).tolist():
        which = np.flatnonzero(sizes == size)
        out[which] = np.median(values[starts[which][:, None] + np.arange(size)], axis=1)
    return out


def detect_stragglers(
    trace: Trace,
    max_p_value: float = 1e-4,
    min_delay_ns: float | None = None,
    explained_by_links: frozenset[int] = frozenset(),
    since_ns: int | None = None,
    problems: list[str] | None = None,
) -> list[Finding]:
    """``min_delay_ns``: the least margin that is a measurement (default: one tick of the timestamps'
    measured resolution). ``explained_by_links``: endpoints of slow links; lateness they pass on is not a
    straggler. ``since_ns``: only collectives entered from then on (the steps after a fail-slow onset).
    ``problems`` gets the numbers of a rank whose margin the job's noise still covers (when nobody is
    named, and the rank is no slow link's endpoint: lateness a named rank or link passes on is no news)."""
    calls = trace.calls
    mask = is_collective(calls["op"])
    if trace.has_returns:
        mask &= calls["t_return"] > 0
    if since_ns is not None:
        mask &= calls["t_call"] >= since_ns
    instances = instances_of(trace, mask)
    if not len(instances):
        return []
    sizes = instances.sizes
    expected = _comm_sizes(trace, instances)
    complete = (sizes == expected) & (sizes >= 2)
    waits = _waits(trace, instances.rows) if trace.has_returns else _arrival_waits(trace, instances, complete)

    candidates: list[_Candidate] = []
    for size in np.unique(sizes[complete]).tolist():
        chosen = np.flatnonzero(complete & (sizes == size))
        grid = instances.starts[chosen][:, None] + np.arange(size)
        block_waits, block_rows = waits[grid], instances.rows[grid]
        # the communicators of this size only (instances come by communicator): arrays of every
        # communicator x this size would be [thousands, 16k] for a world communicator
        present, comm_of = factorize(instances.comm_index[chosen])
        per_comm = np.bincount(comm_of, minlength=len(present))
        median = np.median(block_waits, axis=1, keepdims=True)
        key = comm_of[:, None] * size + np.arange(size)
        below = np.bincount(key[block_waits < median], minlength=len(per_comm) * size).reshape(-1, size)
        last = np.bincount(key[:, 0] + np.argmin(block_waits, axis=1), minlength=len(per_comm) * size)
        last = last.reshape(-1, size)
        trials = np.repeat(per_comm[:, None], size, axis=1)
        share = last / np.maximum(trials, 1)
        maybe = (trials >= MIN_INSTANCES) & (below >= 0.5 * trials)
        consistent = np.zeros_like(maybe)
        where = np.nonzero(maybe)
        consistent[where] = sign_tail(below[where], trials[where]) <= max_p_value
        # many members mostly early together is the job's structure (a pipeline stage), not a fault
        mostly = (trials >= MIN_INSTANCES) & (below >= 0.7 * trials)
        structural = (consistent | mostly).sum(axis=1) > max(1, size // 4)
        chosen_members = consistent & ~structural[:, None] & (share >= min(2 / size, 0.5))
        for comm_position, position in zip(*np.nonzero(chosen_members), strict=True):
            in_comm = comm_of == comm_position
            candidates.append(
                _Candidate(
                    comm=int(instances.comm_ids[present[comm_position]]),
                    ranks=calls["rank"][block_rows[np.argmax(in_comm)]],
                    waits=block_waits[in_comm],
                    rows=block_rows[in_comm],
                    position=int(position),
                    last_share=float(share[comm_position, position]),
                )
            )
    if min_delay_ns is None:
        tick = clock_tick_at(calls["t_call"], instances.rows)
        timed_tick = clock_tick_at(calls["gpu_start"], instances.rows) if trace.has_returns else 1
        min_delay_ns = float(max(tick, timed_tick))
    return _findings(trace, candidates, min_delay_ns, explained_by_links, problems)


def _comm_sizes(trace: Trace, instances: Instances) -> np.ndarray:
    known = np.array([trace.comms[int(c)].size if int(c) in trace.comms else -1 for c in instances.comm_ids.tolist()])
    sizes = known[instances.comm_index] if len(known) else np.zeros(0, np.int64)
    return np.where(sizes > 0, sizes, instances.sizes)


def _gaps(trace: Trace, rows: np.ndarray) -> np.ndarray:
    """Time each call's rank spent outside NCCL before it (its compute): since the previous call
    ended (on the GPU when timed), NaN where unknown. Same shape as ``rows``."""
    calls = trace.calls
    flat = rows.reshape(-1)
    previous = np.maximum(flat - 1, 0)
    if trace.has_returns:
        timed = (calls["gpu_start"][flat] > 0) & (calls["gpu_end"][previous] > 0)
        start = np.where(timed, calls["gpu_start"][flat], calls["t_call"][flat])
        end = np.where(timed, calls["gpu_end"][previous], calls["t_return"][previous])
    else:
        start, end = calls["t_call"][flat], calls["t_call"][previous]
    known = (flat > 0) & (calls["rank"][previous] == calls["rank"][flat]) & (end > 0)
    return np.where(known, (start - end).astype(np.float64), np.nan).reshape(rows.shape)


def _gpu_queue_ns(trace: Trace, rows: np.ndarray) -> float | None:
    """Median time from a rank's call (host launch) to its collective's GPU start, over its GPU-timed
    calls: long when the GPU is still busy with earlier work (the host runs ahead), near zero when
    the GPU was idle waiting for the host. None without GPU timing."""
    calls = trace.calls
    start = calls["gpu_start"][rows]
    timed = start > 0
    if not timed.any():
        return None
    return float(np.median((start[timed] - calls["t_call"][rows][timed]).astype(np.float64)))


def _findings(
    trace: Trace,
    candidates: list[_Candidate],
    min_delay_ns: float,
    explained_by_links: frozenset[int],
    problems: list[str] | None,
) -> list[Finding]:
    z_needed = chance_tail(max(2, len(trace.ranks)))
    best: dict[int, Finding] = {}
    flagged_in: dict[int, set[int]] = {}  # rank -> communicators it was flagged in
    weak: list[str] = []  # candidates the noise still covers: told only when nobody is named
    for candidate in candidates:
        waits, size, position = candidate.waits, candidate.waits.shape[1], candidate.position
        own = waits[:, position]
        others = np.delete(waits, position, axis=1) if size <= 16 else waits  # one hardly moves the median of many
        peer_median = np.median(others, axis=1)
        margins = peer_median - own
        delay = float(np.median(margins))
        error = median_standard_error(margins)
        z = delay / error if error > 0 else (float("inf") if delay > 0 else 0.0)
        gaps = _gaps(trace, candidate.rows)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: no previous call known
            typical_gap = float(np.nanmedian(gaps)) if np.isfinite(gaps).any() else 0.0
            excess = float(np.nanmedian(gaps[:, position] - np.nanmedian(np.delete(gaps, position, axis=1), axis=1)))
        if delay < max(min_delay_ns, RELATIVE_DELAY * typical_gap):
            continue
        if z < z_needed:
            if int(candidate.ranks[position]) not in explained_by_links:
                weak.append(
                    f"{trace.label(int(candidate.ranks[position]))} arrives last at the collectives of "
                    f"{trace.comm_name(candidate.comm)} by {delay / 1e6:.3f} ms (median over {len(waits)}), but its "
                    f"collectives spread so much that this is z {z:.1f} where {z_needed:.1f} names a rank: "
                    "a slowdown is not localisable"
                )
            continue
        # Lateness passed on by someone else (a pipeline partner, its place in the pipeline) comes with
        # normal compute; a straggler's own compute is longer. Call times alone cannot tell them apart.
        own_compute = not trace.has_returns or not np.isfinite(excess) or excess >= 0.5 * delay
        if not own_compute:
            continue
        # no two GPUs run alike (1-2% apart): one hardly slower than its peers is not worth a cordon
        if trace.has_returns and np.isfinite(excess) and typical_gap > 0 and excess < MIN_EXCESS * typical_gap:
            continue
        rank = int(candidate.ranks[position])
        spread = 1.4826 * float(np.median(np.abs(waits - np.median(waits, axis=1, keepdims=True)))) + min_delay_ns
        confidence = candidate.last_share * min(1.0, z / (2 * z_needed))
        what = "waits" if trace.has_returns else "arrives later: it waits"
        queued = _gpu_queue_ns(trace, candidate.rows[:, position])
        own_wait, peers_wait = float(np.median(own)), float(np.median(peer_median))
        finding = Finding(
            kind="straggler",
            ranks=[rank],
            nodes=[trace.node_of(rank)],
            communicator=comm_label(candidate.comm),
            confidence=round(float(confidence), 3),
            summary=(
                f"{trace.label(rank)} arrives last at the collectives of {trace.comm_name(candidate.comm)} "
                f"({size} ranks): it {what} {own_wait / 1e6:.2f} ms vs its peers' {peers_wait / 1e6:.2f} ms "
                f"(median over {len(waits)} collectives; last in {candidate.last_share:.0%} of them)"
            ),
            evidence={
                "own_wait_ms": round(own_wait / 1e6, 4),
                "peer_wait_ms": round(peers_wait / 1e6, 4),
                "delay_ms": round(delay / 1e6, 4),
                "compute_excess_ms": round(excess / 1e6, 4) if np.isfinite(excess) else None,
                # its extra time between calls against a typical rank's: how much slower it runs
                "slowdown": round(excess / typical_gap, 3) if np.isfinite(excess) and typical_gap > 0 else None,
                "own_compute": own_compute,
                # host launch to GPU start of its collectives: GPU work still queued ahead of them
                "gpu_queue_ms": round(queued / 1e6, 4) if queued is not None else None,
                "score": round(delay / spread, 2),
                # the margin against the standard error of its median, and what names a rank in a job this size
                "z": round(z, 1) if np.isfinite(z) else None,
                "z_needed": round(z_needed, 2),
                "delay_floor_ms": round(max(min_delay_ns, RELATIVE_DELAY * typical_gap) / 1e6, 4),
                "last_share": round(candidate.last_share, 3),
                "collectives": len(waits),
                "communicator_size": size,
            },
        )
        flagged_in.setdefault(rank, set()).add(candidate.comm)
        if rank not in best or _strength(finding) > _strength(best[rank]):
            best[rank] = finding
    if not best and problems is not None:
        problems.extend(weak)
    return [best[rank] for rank in _root_causes(trace, best, flagged_in, explained_by_links)]


def _strength(finding: Finding) -> tuple[bool, int, float]:
    """A rank slow in its own compute explains the lateness it passes on; then evidence from a larger
    communicator (more peers doing the same work) beats a pair."""
    return finding.evidence["own_compute"], finding.evidence["communicator_size"], finding.confidence


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
    if not best:
        return []
    partners_of: dict[int, set[int]] = {}

    def partners(rank: int) -> set[int]:
        """The ranks this one sends to or receives from."""
        if rank not in partners_of:
            rows = trace.rows_of(rank)
            p2p = np.flatnonzero(is_p2p(trace.calls["op"][rows])) + rows.start
            found = set()
            for comm_id, peer in set(zip(trace.calls["comm"][p2p].tolist(), trace.calls["peer"][p2p].tolist(),
                                         strict=True)):  # fmt: skip
                comm = trace.comms.get(comm_id)
                if comm and peer in comm.members:
                    found.add(comm.members[peer])
            partners_of[rank] = found
        return partners_of[rank]

    members = {comm_id: set(comm.members.values()) for comm_id, comm in trace.comms.items()}

    near_of: dict[int, set[int]] = {}

    def near(rank: int) -> set[int]:
        """Whom a late ``rank`` delays directly: its partners and its peers where it was flagged."""
        if rank not in near_of:
            found = {rank} | partners(rank)
            for comm_id in flagged_in.get(rank, ()):
                found |= members.get(comm_id, set())
            near_of[rank] = found
        return near_of[rank]

    def within_two_hops(x: int, y: int) -> bool:
        """x near y, or one of x's partners near y (partnership is mutual): only x's partners are
        looked up, never those of everyone near y (a world communicator's 16k members)."""
        return x in near(y) or not partners(x).isdisjoint(near(y))

    def related(x: int, y: int) -> bool:
        return within_two_hops(x, y) or within_two_hops(y, x)

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
