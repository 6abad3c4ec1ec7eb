"""When call times are all there is (Megatrace, gloo dumps): a straggler shows as a window of lateness.

A rank slowed for a while (a throttled GPU, a noisy neighbour) arrives after its peers by milliseconds
for tens of seconds; over the whole log that is a fraction of its calls, and a whole-log comparison
also flags ranks that are behind by a tenth of a millisecond every time (launch order: structure,
not a fault). So each straggler finding from call times is checked for a window: consecutive
``WINDOW_S`` bins (a twentieth of a shorter trace) in which the rank's median lateness behind its
peers' median arrival is at least 3% of the time between its calls there (and one tick of the
timestamps' measured resolution: a shorter lateness is no measurement); of those, the run with the
most lateness (median times duration). A finding without one is dropped (and said so, with its
numbers); a pipeline neighbour (same tp and dp, adjacent stage: it receives the late rank's
activations or gradients) late in the same window by less is the lateness passed on; the rank left
gets its window as evidence.

What run-ahead cannot explain. On a GPU the host enqueues and goes on, blocking only where it
synchronises, so the order in which hosts reach a call is mostly launch order and host habits, not who
the GPUs wait for: a GPU-bound job shows persistent sub-millisecond lateness of some host (the first
rank of a TP group), the last pipeline stage's host arrives last by tens of milliseconds (it alone
blocks on the loss), and a GPU slowdown hides behind the hosts' run-ahead (the stand-in device shows
all three). A host that is itself the bottleneck is different: its peers' GPUs wait for its launches,
so it is behind them by as much as it holds the job back, step after step. Hence, from call times of
NCCL (Megatrace logs), a rank is named only when
- it is late behind peers of its own pipeline stage: a communicator spanning stages (by the layout,
  else two members in one communicator that carries sends and receives) is not evidence;
- its window's median lateness stands out of the job's own host noise: the same bins' median lateness
  of the ranks of sibling communicators (the same size, so the same place in the step; up to
  ``REFERENCE_COMMS`` of them; its own communicator's other members too when it has more than two),
  pooled; the window must lie beyond their median by their spread
  (1.4826 x MAD, which the few late among them hardly move) times the Student tail that a job of this
  many ranks reaches by chance once in 500 jobs, the spread measured from that many sibling ranks
  (job_noise.py): launch order, host jitter and run-ahead slack are what those ranks show;
- the window is longer than any burst of those ranks beyond the same bar (and two bins at least; other
  stragglers and the ranks of its own pipeline, which its lateness reaches as long as it lasts, left
  out): a
  host that fell behind for a moment (a garbage collection, a checkpoint) is what every rank does now
  and then, not a node to cordon.
Otherwise the report says the slowdown is not localisable from call times and names nobody (a GPU
slowdown is what GPU timing finds). Megatrace's published sample (rank 2 behind its TP partner by
2.1 ms for 35 s, where the other TP groups' quiet ranks spread 0.10 ms a bin and burst for one bin at
most) passes all three, at z 20. Calls that block on the host until their collective is done (gloo
on CPU: ``Trace.calls_block_on_host``) have no GPU running behind them: there the window alone
decides, as before.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from rankwatch.analysis.findings import Finding
from rankwatch.analysis.job_noise import chance_tail, clock_tick_ns, robust_spread
from rankwatch.analysis.trace import Trace, is_p2p

WINDOW_S = 5.0
LATE_SHARE = 0.03  # nobody would act on lateness below 3% of the time between the rank's calls there
MIN_BINS = 2
MAX_MEMBERS = 2048  # lateness against peers is computed member by member
REFERENCE_COMMS = 32  # sibling communicators whose quiet ranks measure the job's host noise (a sample at scale)
NOT_LOCALISABLE_FROM_CALLS = (
    "not localisable from call times; enable GPU timing (rankwatch rings, spec.tracing.gpuTiming)"
)


def _lateness(trace: Trace, rank: int, comm_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(call time, lateness in ns behind the median of the peers' calls) per instance ``rank`` logged,
    each node's clock offset removed: the median lateness of its ranks, which one slow rank does not move."""
    comm = trace.comms.get(comm_id)
    if comm is None or comm.size > MAX_MEMBERS:
        return np.zeros(0, np.int64), np.zeros(0)
    members = sorted(comm.members.values())
    own = trace.calls[trace.rows_of(rank)]
    own = own[own["comm"] == comm_id]
    seqs = np.unique(own["seq"])
    grid = np.full((len(members), len(seqs)), np.nan)
    for row, member in enumerate(members):
        calls = trace.calls[trace.rows_of(member)]
        calls = calls[calls["comm"] == comm_id]
        _, where, theirs = np.intersect1d(seqs, calls["seq"], return_indices=True)
        grid[row, where] = calls["t_call"][theirs].astype(np.float64)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        late = grid - np.nanmedian(grid, axis=0)  # behind the median arrival of each instance
        per_rank = np.nanmedian(late, axis=1)
        nodes = [trace.node_of(member) for member in members]
        offset = {
            node: float(np.nanmedian([per_rank[i] for i, n in enumerate(nodes) if n == node])) for node in set(nodes)
        }
    mine = members.index(rank)
    known = ~np.isnan(grid[mine])
    correction = offset[nodes[mine]] if np.isfinite(offset[nodes[mine]]) else 0.0
    return grid[mine][known].astype(np.int64), late[mine][known] - correction


def _bin_width(t: np.ndarray) -> int:
    return max(1, min(int(WINDOW_S * 1e9), int(t.max() - t.min()) // 20))  # short traces: 20 bins


def _bin_medians(t: np.ndarray, late: np.ndarray, origin: int, width: int) -> np.ndarray:
    """Median lateness per bin of ``width`` ns from ``origin``; NaN where the rank made no call."""
    bins = ((t - origin) // width).astype(np.int64)
    out = np.full(int(bins.max()) + 1 if len(bins) else 0, np.nan)
    for number in np.unique(bins).tolist():
        out[number] = float(np.median(late[bins == number]))
    return out


def _longest_run(beyond: np.ndarray, present: np.ndarray) -> int:
    """The most consecutive present bins that are beyond a bar (an absent bin neither breaks nor extends)."""
    longest = run = 0
    for is_beyond in beyond[present].tolist():
        run = run + 1 if is_beyond else 0
        longest = max(longest, run)
    return longest


def late_window(trace: Trace, rank: int, comm_id: int, structural_ns: float = 0.0) -> dict[str, float] | None:
    """The longest run of bins in which ``rank`` is late behind its peers (see the module), or None."""
    t, late = _lateness(trace, rank, comm_id)
    late = late - structural_ns
    if len(t) < MIN_BINS:
        return None
    width = _bin_width(t)
    medians = _bin_medians(t, late, int(t.min()), width)
    threshold = max(clock_tick_ns(t), LATE_SHARE * float(np.median(np.diff(np.sort(t)))))
    best: list[int] = []
    best_area, run, area = 0.0, [], 0.0
    for number, median in enumerate(medians.tolist()):
        if np.isnan(median):
            continue  # an empty bin neither breaks nor extends a run
        if median >= threshold:
            run, area = [*run, number], area + median
            if len(run) >= MIN_BINS and area > best_area:
                best, best_area = list(run), area
        else:
            run, area = [], 0.0
    if not best:
        return None
    inside = np.isin(((t - t.min()) // width).astype(np.int64), best)
    return {
        "start_ns": int(t[inside].min()),
        "end_ns": int(t[inside].max()),
        "seconds": round(float(t[inside].max() - t[inside].min()) / 1e9, 1),
        "median_late_ms": round(float(np.median(late[inside])) / 1e6, 3),
        "collectives": int(inside.sum()),
        "bins": len(best),
        "bin_ns": width,
    }


@dataclass(frozen=True)
class HostNoise:
    """The lateness a job's hosts show without holding anyone back, per bin of a window's width."""

    centre_ns: float
    spread_ns: float  # 1.4826 x MAD of the quiet ranks' bin medians
    tail: float  # the z this many quiet ranks reach by chance once in 500 jobs
    longest_burst_bins: int  # the longest run of bins beyond the bar of a sibling rank it did not make late
    ranks: int

    @property
    def bar_ns(self) -> float:
        return self.centre_ns + self.tail * self.spread_ns

    def z(self, late_ns: float) -> float:
        return (late_ns - self.centre_ns) / self.spread_ns if self.spread_ns > 0 else float("inf")


def host_noise(trace: Trace, comm_id: int, rank: int, not_quiet: set[int], width: int) -> HostNoise | None:
    """The job's host noise beside ``comm_id``: the bin medians of the members of its sibling
    communicators (same size; an even sample of ``REFERENCE_COMMS``), and of its own other members when
    it has more than two (in a pair the other one only mirrors the judged rank), their spread robust to
    the few late among them; their bursts leave out the ``not_quiet`` ranks (other stragglers, and the
    lateness the judged rank passed on, as long as its own). The tail is for every rank of the job, the
    spread measured from that many."""
    comm = trace.comms.get(comm_id)
    if comm is None:
        return None
    siblings = sorted(c for c, other in trace.comms.items() if other.size == comm.size and c != comm_id)
    if len(siblings) > REFERENCE_COMMS:
        siblings = [siblings[i] for i in np.linspace(0, len(siblings) - 1, REFERENCE_COMMS).astype(int).tolist()]
    times = trace.calls["t_call"][trace.calls["t_call"] > 0]
    if not len(times):
        return None
    origin = int(times.min())
    per_rank: dict[tuple[int, int], np.ndarray] = {}  # (communicator, member) -> its bin medians
    if comm.size > 2:
        siblings.append(comm_id)
    for sibling in siblings:
        for member in sorted(set(trace.comms[sibling].members.values()) - {rank}):
            t, late = _lateness(trace, member, sibling)
            if len(t) >= MIN_BINS:
                per_rank[(sibling, member)] = _bin_medians(t, late, origin, width)
    if len(per_rank) < 2:
        return None
    pooled = np.concatenate(list(per_rank.values()))
    pooled = pooled[np.isfinite(pooled)]
    centre, spread = float(np.median(pooled)), robust_spread(pooled)
    tail = chance_tail(max(len(trace.ranks), len(per_rank)), len(per_rank) - 1)
    bar = centre + tail * spread
    quiet = [medians for (_, member), medians in per_rank.items() if member not in not_quiet]
    burst = max((_longest_run(medians >= bar, np.isfinite(medians)) for medians in quiet), default=0)
    return HostNoise(centre, spread, tail, burst, len(per_rank))


def _position(trace: Trace, finding: Finding) -> tuple[int, int] | None:
    comm = trace.comms.get(int(finding.communicator or "0", 16))
    if comm is None:
        return None
    return comm.size, next((i for i, r in comm.members.items() if r == finding.ranks[0]), -1)


def _structural_lateness(trace: Trace, findings: list[Finding]) -> dict[int, float]:
    """rank -> lateness (ns) its place shares with the same place of most sibling communicators (the
    same size): tp 0 behind tp 1 in every TP group by 0.1 ms is launch order, not a straggler."""
    stragglers = [f for f in findings if f.kind == "straggler" and f.communicator]
    places: dict[tuple[int, int], list[Finding]] = {}
    for finding in stragglers:
        if (place := _position(trace, finding)) is not None:
            places.setdefault(place, []).append(finding)
    siblings: dict[int, int] = {}
    for comm in trace.comms.values():
        siblings[comm.size] = siblings.get(comm.size, 0) + 1
    out = {}
    for (size, _), same in places.items():
        if len(same) >= max(3, siblings.get(size, 0) / 2):
            baseline = float(np.median([f.evidence.get("delay_ms", 0.0) for f in same])) * 1e6
            out.update({f.ranks[0]: baseline for f in same})
    return out


def _neighbours(trace: Trace, a: int, b: int) -> bool:
    if trace.layout is None:
        return False
    (ta, da, pa), (tb, db, pb) = trace.layout.coords(a), trace.layout.coords(b)
    return ta == tb and da == db and abs(pa - pb) == 1


def _pipeline_of(trace: Trace, rank: int, pipelines: list[set[int]]) -> set[int]:
    """The ranks of ``rank``'s pipeline (same tp and dp by the layout, else those it sends to or receives
    from): its lateness reaches them through its activations and gradients."""
    if trace.layout is not None:
        tp, dp, _ = trace.layout.coords(rank)
        return {r for r in trace.ranks if trace.layout.coords(r)[:2] == (tp, dp)}
    return set().union(*(pipeline for pipeline in pipelines if rank in pipeline))


def _overlap(x: dict[str, float], y: dict[str, float]) -> bool:
    return x["start_ns"] <= y["end_ns"] and y["start_ns"] <= x["end_ns"]


def _pipeline_comms(trace: Trace) -> list[set[int]]:
    """Members of each communicator that carries sends and receives: a pipeline, one rank per stage."""
    calls = trace.calls
    comm_ids = np.unique(calls["comm"][is_p2p(calls["op"])]).tolist()
    return [set(trace.comms[c].members.values()) for c in comm_ids if c in trace.comms]


def spans_stages(trace: Trace, comm_id: int, pipelines: list[set[int]]) -> bool:
    """The communicator's members lie in more than one pipeline stage (by the layout when known, else
    two of them in one pipeline communicator)."""
    comm = trace.comms.get(comm_id)
    if comm is None:
        return True
    members = set(comm.members.values())
    if trace.layout is not None:
        return len({trace.layout.coords(rank)[2] for rank in members}) > 1
    return any(len(members & pipeline) > 1 for pipeline in pipelines)


def _not_localisable(trace: Trace, finding: Finding, why: str) -> str:
    return (
        f"{trace.label(finding.ranks[0])} arrives after its peers at {trace.comm_name(int(finding.communicator, 16))}"
        f" ({why}): what hosts running ahead of their GPUs show; a slowdown is {NOT_LOCALISABLE_FROM_CALLS}"
    )


def host_bound(window: dict[str, float], noise: HostNoise) -> bool:
    """A window of lateness that run-ahead cannot explain (see the module)."""
    late = window["median_late_ms"] * 1e6
    return late >= noise.bar_ns and window["bins"] > max(MIN_BINS - 1, noise.longest_burst_bins)


def windowed_stragglers(trace: Trace, findings: list[Finding], problems: list[str]) -> list[Finding]:
    """The straggler findings of a call-times-only trace that a lateness window bears out and run-ahead
    cannot explain (others kept); those it can are dropped, and the problems say so."""
    if trace.has_returns or trace.calls_block_on_host:  # gloo: analysis/peer_lateness.py decided already
        return findings
    structural = _structural_lateness(trace, findings)
    windows: dict[int, dict[str, float]] = {}
    kept: list[Finding] = []
    candidates = []
    pipelines = _pipeline_comms(trace)
    for finding in findings:
        if finding.kind != "straggler" or not finding.communicator:
            kept.append(finding)
            continue
        if not trace.calls_block_on_host and spans_stages(trace, int(finding.communicator, 16), pipelines):
            why = f"{finding.evidence.get('delay_ms', 0):.2f} ms, in a communicator spanning pipeline stages"
            problems.append(_not_localisable(trace, finding, why))
            continue
        rank = finding.ranks[0]
        window = late_window(trace, rank, int(finding.communicator, 16), structural.get(rank, 0.0))
        if window is None:
            problems.append(
                f"rank {rank} arrives last more often than its peers but by "
                f"{finding.evidence.get('delay_ms', 0):.3f} ms (median), {structural.get(rank, 0) / 1e6:.3f} ms of "
                "it shared by the same place in most sibling communicators, and never late beyond that by 3% of "
                "the time between its calls: not reported (call times alone)"
            )
            continue
        windows[rank] = window
        candidates.append(finding)
    candidates.sort(key=lambda f: -windows[f.ranks[0]]["median_late_ms"] * windows[f.ranks[0]]["collectives"])
    accepted: list[Finding] = []
    passed_on: dict[int, set[int]] = {}  # an accepted rank -> the neighbours whose lateness it explains
    for finding in candidates:
        rank = finding.ranks[0]
        causes = [a.ranks[0] for a in accepted if _neighbours(trace, rank, a.ranks[0])]
        cause = next((c for c in causes if _overlap(windows[rank], windows[c])), None)
        if cause is not None:
            passed_on.setdefault(cause, set()).add(rank)
            problems.append(
                f"rank {rank} is late by {windows[rank]['median_late_ms']:.2f} ms while its pipeline neighbour, "
                f"rank {cause}, is late: passed on, not reported"
            )
            continue
        finding.evidence["late_window"] = windows[rank]
        accepted.append(finding)
    bound = []
    late_ranks = {f.ranks[0] for f in findings if f.kind == "straggler"}  # their bursts are no host noise
    for finding in accepted:
        window = finding.evidence["late_window"]
        if trace.calls_block_on_host:
            bound.append(finding)
            continue
        comm_id = int(finding.communicator, 16)
        width = int(window["bin_ns"])
        rank = finding.ranks[0]
        not_quiet = late_ranks | passed_on.get(rank, set()) | _pipeline_of(trace, rank, pipelines)
        noise = host_noise(trace, comm_id, rank, not_quiet, width)
        if noise is None:
            why = f"{window['median_late_ms']:.2f} ms for {window['seconds']:.1f} s, and no sibling ranks to compare"
            problems.append(_not_localisable(trace, finding, why))
            continue
        z = noise.z(window["median_late_ms"] * 1e6)
        window.update(
            host_noise_ms=round(noise.spread_ns / 1e6, 4),
            z=round(z, 1) if np.isfinite(z) else None,
            z_needed=round(noise.tail, 2),
            longest_sibling_burst_bins=noise.longest_burst_bins,
            sibling_ranks=noise.ranks,
        )
        if host_bound(window, noise):
            bound.append(finding)
        else:
            why = (
                f"{window['median_late_ms']:.2f} ms for {window['seconds']:.1f} s ({window['bins']} bins), z {z:.1f}; "
                f"a host holding its job back stands out of its {noise.ranks} sibling ranks' lateness "
                f"({noise.spread_ns / 1e6:.3f} ms a bin) by z {noise.tail:.1f}, for longer than their longest burst "
                f"({noise.longest_burst_bins} bins)"
            )
            del finding.evidence["late_window"]
            problems.append(_not_localisable(trace, finding, why))
    return kept + bound
