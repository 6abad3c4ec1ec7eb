"""When call times are all there is (Megatrace, gloo dumps): a straggler shows as a window of lateness.

A rank slowed for a while (a throttled GPU, a noisy neighbour) arrives after its peers by milliseconds
for tens of seconds; over the whole log that is a fraction of its calls, and a whole-log comparison
also flags ranks that are behind by a tenth of a millisecond every time (launch order: structure,
not a fault). So each straggler finding from call times is checked for a window: consecutive
``WINDOW_S`` bins (a twentieth of a shorter trace) in which the rank's median lateness behind its
peers' median arrival is at least 3% of the time between its calls there (and 0.02 ms); of those, the
run with the most lateness (median times duration). A finding without one is dropped (and said so,
with its numbers); a pipeline neighbour (same tp and dp, adjacent stage: it receives the late rank's
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
- its window's median lateness is at least ``HOST_LATE_MS`` (1 ms: beyond launch order, host jitter
  and the run-ahead slack of the jobs where it would matter);
- the window lasts ``HOST_LATE_SECONDS`` (10 s) or more: a host that fell behind for a burst (a
  garbage collection, a checkpoint) is not a node to cordon.
Otherwise the report says the slowdown is not localisable from call times and names nobody (a GPU
slowdown is what GPU timing finds). Megatrace's published sample (rank 2 behind its TP partner by
2.1 ms for 35 s) passes all three. Calls that block on the host until their collective is done (gloo
on CPU: ``Trace.calls_block_on_host``) have no GPU running behind them: there the window alone
decides, as before.
"""

from __future__ import annotations

import warnings

import numpy as np

from rankwatch.analysis.findings import Finding
from rankwatch.analysis.trace import P2P_OPS, Trace

WINDOW_S = 5.0
LATE_FLOOR_MS = 0.02  # below this nobody would act on lateness (the straggler floor)
LATE_SHARE = 0.03  # ... nor below 3% of the time between the rank's calls there (the straggler rule)
MIN_BINS = 2
MAX_MEMBERS = 2048  # lateness against peers is computed member by member
HOST_LATE_MS = 1.0  # a host this far behind its stage's peers holds their GPUs back (see the module)
HOST_LATE_SECONDS = 10.0  # ... for this long: not a burst
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


def late_window(trace: Trace, rank: int, comm_id: int, structural_ns: float = 0.0) -> dict[str, float] | None:
    """The longest run of bins in which ``rank`` is late behind its peers (see the module), or None."""
    t, late = _lateness(trace, rank, comm_id)
    late = late - structural_ns
    if len(t) < MIN_BINS:
        return None
    width = max(1, min(int(WINDOW_S * 1e9), int(t.max() - t.min()) // 20))  # short traces: 20 bins
    bins = ((t - t.min()) // width).astype(np.int64)
    threshold = max(LATE_FLOOR_MS * 1e6, LATE_SHARE * float(np.median(np.diff(np.sort(t)))))
    best: list[int] = []
    best_area, run, area = 0.0, [], 0.0
    for number in range(int(bins.max()) + 1):
        inside = bins == number
        if not inside.any():
            continue  # an empty bin neither breaks nor extends a run
        median = float(np.median(late[inside]))
        if median >= threshold:
            run, area = [*run, number], area + median
            if len(run) >= MIN_BINS and area > best_area:
                best, best_area = list(run), area
        else:
            run, area = [], 0.0
    if not best:
        return None
    inside = np.isin(bins, best)
    return {
        "start_ns": int(t[inside].min()),
        "end_ns": int(t[inside].max()),
        "seconds": round(float(t[inside].max() - t[inside].min()) / 1e9, 1),
        "median_late_ms": round(float(np.median(late[inside])) / 1e6, 3),
        "collectives": int(inside.sum()),
    }


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


def _overlap(x: dict[str, float], y: dict[str, float]) -> bool:
    return x["start_ns"] <= y["end_ns"] and y["start_ns"] <= x["end_ns"]


def _pipeline_comms(trace: Trace) -> list[set[int]]:
    """Members of each communicator that carries sends and receives: a pipeline, one rank per stage."""
    calls = trace.calls
    comm_ids = np.unique(calls["comm"][np.isin(calls["op"], P2P_OPS)]).tolist()
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


def host_bound(window: dict[str, float]) -> bool:
    """A window of lateness that run-ahead cannot explain (see the module)."""
    return window["median_late_ms"] >= HOST_LATE_MS and window["seconds"] >= HOST_LATE_SECONDS


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
    for finding in candidates:
        rank = finding.ranks[0]
        causes = [a.ranks[0] for a in accepted if _neighbours(trace, rank, a.ranks[0])]
        cause = next((c for c in causes if _overlap(windows[rank], windows[c])), None)
        if cause is not None:
            problems.append(
                f"rank {rank} is late by {windows[rank]['median_late_ms']:.2f} ms while its pipeline neighbour, "
                f"rank {cause}, is late: passed on, not reported"
            )
            continue
        finding.evidence["late_window"] = windows[rank]
        accepted.append(finding)
    bound = []
    for finding in accepted:
        window = finding.evidence["late_window"]
        if trace.calls_block_on_host or host_bound(window):
            bound.append(finding)
        else:
            why = (
                f"{window['median_late_ms']:.2f} ms for {window['seconds']:.1f} s; "
                f"a host holding its job back: {HOST_LATE_MS:g} ms or more for {HOST_LATE_SECONDS:g} s or more"
            )
            problems.append(_not_localisable(trace, finding, why))
    return kept + bound
