"""Hang localisation: the rank(s) the job waits for, not the thousands that wait.

A call that has not returned and is older than ``stall_seconds`` is a wait.
For a collective, the members of its communicator that never entered that sequence number are what
it waits for; for a send/receive, the peer that never posted the matching receive/send. Following
those edges from rank to rank ends either at a rank that waits for nothing (it stopped outside NCCL:
the culprit) or at a collective that every member entered and none left (a rank is stuck inside it;
with GPU timing, the member whose GPU work never started is the culprit). Sequence numbers are only
ever compared within one communicator.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np

from rankwatch.analysis.findings import Finding, comm_label, utc_text
from rankwatch.analysis.ring import Op
from rankwatch.analysis.sync_points import not_culprits
from rankwatch.analysis.trace import Communicator, Trace, is_collective, is_p2p


def _describe_call(row: np.void) -> str:
    return f"{Op(int(row['op'])).name.title().replace('_', '')} #{int(row['seq'])}"


def _instance_keys(comm: np.ndarray, seq: np.ndarray) -> np.ndarray:
    return (comm.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ seq.astype(np.uint64)


def _among(values: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """``np.isin(values, wanted)`` for a few thousand wanted among millions: a binary search each
    rather than a sort of them all."""
    ordered = np.unique(wanted)
    if not len(ordered):
        return np.zeros(len(values), bool)
    at = np.searchsorted(ordered, values)
    at[at == len(ordered)] = 0
    return ordered[at] == values


def _queued(calls: np.ndarray, pending: np.ndarray) -> np.ndarray:
    """Mask of the calls in flight that wait behind an earlier call of their own rank: on an
    asynchronous GPU the host runs ahead and its later calls queue on the stream, unstarted, behind the
    one the GPU is in. A rank's head is what its GPU started (or, when nothing started, its oldest call
    in flight and the calls grouped with it); the rest of its calls in flight are queued."""
    queued = np.zeros(len(calls), bool)
    rows = np.flatnonzero(pending)
    if not len(rows):
        return queued
    ranks = calls["rank"][rows]  # each rank's calls in flight, in call order
    is_head = np.r_[True, ranks[1:] != ranks[:-1]]
    rank_of = np.cumsum(is_head) - 1  # columns, not a loop over ranks: a 16k-rank hang has 16k of them
    started = calls["gpu_start"][rows] > 0
    any_started = np.bincount(rank_of, weights=started, minlength=int(rank_of[-1]) + 1) > 0
    group = calls["group"][rows]
    head_group = group[np.flatnonzero(is_head)][rank_of]
    behind_head = ~is_head & ~((head_group != 0) & (group == head_group))
    queued[rows] = np.where(any_started[rank_of], ~started, behind_head)
    return queued


def _entered(
    trace: Trace, stalled: np.ndarray, queued: np.ndarray, completion_known: bool
) -> tuple[dict[tuple[int, int], set[int]], dict[tuple[int, int], set[int]], dict[tuple[int, int], set[int]]]:
    """(communicator, sequence) of each stalled collective -> the members that entered it; of those,
    the ones whose call there is queued behind their own earlier work (they have not reached it); and
    the ones whose call there is over (with completion known: nobody can be stuck in it then).

    With return times the calls that never returned are searched first (a 16k-rank hang stays cheap);
    with call times alone, all collectives. A member not found there entered the instance when its
    trace reaches that sequence number on the communicator (a rank's calls there are numbered in
    order): its record of the instance may be gone from a wrapped ring or a dump that kept only its
    latest calls, or it may have left the instance long ago."""
    calls = trace.calls
    # only rows numbered within the stalled calls' numbers can be one of their instances: a cheap pass
    # over the numbers first (with call times alone every collective is a candidate: 24 M at 16k ranks)
    seq = calls["seq"]
    candidates = (seq >= stalled["seq"].min()) & (seq <= stalled["seq"].max())
    candidates &= ~is_p2p(calls["op"])
    if completion_known:
        candidates &= calls["t_return"] == 0
    candidates = np.flatnonzero(candidates)
    wanted = _instance_keys(stalled["comm"], stalled["seq"])
    keys = _instance_keys(calls["comm"][candidates], calls["seq"][candidates])
    rows = candidates[_among(keys, wanted)]
    entered: dict[tuple[int, int], set[int]] = {
        (int(c), int(q)): set() for c, q in zip(stalled["comm"].tolist(), stalled["seq"].tolist(), strict=True)
    }
    behind: dict[tuple[int, int], set[int]] = {key: set() for key in entered}
    left: dict[tuple[int, int], set[int]] = {key: set() for key in entered}
    for rank, comm_id, seq, waits in zip(calls["rank"][rows].tolist(), calls["comm"][rows].tolist(),
                                         calls["seq"][rows].tolist(), queued[rows].tolist(), strict=True):  # fmt: skip
        if (comm_id, seq) in entered:
            entered[(comm_id, seq)].add(rank)
            if waits:
                behind[(comm_id, seq)].add(rank)
    own_calls: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}  # (comm, member) -> its seq, t_return there
    for (comm_id, seq), found in entered.items():
        comm = trace.comms.get(comm_id)
        for member in set(comm.members.values()) - found if comm else ():
            if (comm_id, member) not in own_calls:
                own = calls[trace.rows_of(member)]
                own = own[(own["comm"] == comm_id) & ~is_p2p(own["op"])]
                own_calls[(comm_id, member)] = own["seq"], own["t_return"]
            numbers, returns = own_calls[(comm_id, member)]
            if len(numbers) and int(numbers.max()) >= seq:
                found.add(member)
                if completion_known and (returns[numbers == seq] > 0).any():
                    left[(comm_id, seq)].add(member)
    return entered, behind, left


def _roots_behind(waits_for: dict[int, set[int]], stopped: set[int]) -> dict[int, set[int]]:
    """culprit -> the waiting ranks whose chain of waits ends at it (memoised: one pass for 16k ranks)."""
    reaches: dict[int, frozenset[int]] = {rank: frozenset([rank]) for rank in stopped}
    for start in waits_for:
        stack, path = [start], []
        while stack:  # iterative depth-first search; a rank on the current path counts as reaching nothing
            rank = stack[-1]
            if rank in reaches:
                stack.pop()
                continue
            if rank not in path:
                path.append(rank)
                stack.extend(other for other in waits_for.get(rank, ()) if other not in reaches and other not in path)
                continue
            stack.pop()
            path.remove(rank)
            reaches[rank] = frozenset().union(*(reaches.get(other, frozenset()) for other in waits_for.get(rank, ())))
    roots: dict[int, set[int]] = {}
    for start in waits_for:
        for culprit in reaches.get(start, ()):
            roots.setdefault(culprit, set()).add(start)
    return roots


def _behind_in(trace: Trace, comm: Communicator, seq: int, progress_in: dict[int, dict[int, int]]) -> set[int]:
    """Members of ``comm`` whose last call there is numbered below ``seq``: the ones a send/receive
    with an unnamed peer can be waiting for (each exchange advances every participant's count)."""
    if comm.id not in progress_in:
        progress = {}
        for member in comm.members.values():
            own = trace.calls[trace.rows_of(member)]
            numbers = own["seq"][own["comm"] == comm.id]
            progress[member] = int(numbers.max()) if len(numbers) else 0
        progress_in[comm.id] = progress
    return {member for member, last in progress_in[comm.id].items() if last < seq}


def _merge_stopped_together(
    trace: Trace,
    stalled: np.ndarray,
    roots: dict[int, set[int]],
    members_of: dict[int, set[int]],
    stuck: dict[tuple[int, int], np.ndarray],
) -> None:
    """With call times only, the members of a collective that all stopped right after entering it
    look like separate stopped ranks; they are one collective nobody left."""
    last_calls: dict[tuple[int, int], list[int]] = {}
    for culprit in roots:
        own = trace.calls[trace.rows_of(culprit)]
        if len(own) and int(own[-1]["op"]) not in (Op.SEND, Op.RECV):
            last_calls.setdefault((int(own[-1]["comm"]), int(own[-1]["seq"])), []).append(culprit)
    for (comm_id, seq), group in last_calls.items():
        if len(group) > 1 and set(group) == members_of.get(comm_id):
            stuck[(comm_id, seq)] = stalled[(stalled["comm"] == comm_id) & (stalled["seq"] == seq)]
            for culprit in group:
                roots.pop(culprit)


def _follow_unrecorded_partners(
    trace: Trace, waits_for: dict[int, set[int]], waiting: set[int], unknown_peer: set[int]
) -> set[int]:
    """A rank others wait for that is in no recorded call, where the source records no send/receive
    (gloo's flight recorder), may be inside one: with its pipeline neighbours when the layout names
    them (it waits for them), else with someone unnamed. Returns the ranks given such guessed waits."""
    guessed: set[int] = set()
    if not trace.unrecorded_partners:
        return guessed
    changed = True
    while changed:
        changed = False
        for rank in sorted({r for targets in waits_for.values() for r in targets}):
            if rank in waits_for or rank in waiting or rank not in trace.unrecorded_partners:
                continue
            partners = trace.unrecorded_partners[rank] - {rank}
            if partners:
                waits_for[rank] = set(partners)
                guessed.add(rank)
                changed = True
            else:
                unknown_peer.add(rank)
    return guessed


def _p2p_match(trace: Trace, row: np.void, peer: int, queued: np.ndarray, completion_known: bool) -> str:
    """Where the peer of a stalled send/receive is with its matching call: ``missing`` (never made),
    ``queued`` (made, but its GPU never reached it: behind its own earlier work, or its GPU-timed call
    never started while unfinished), ``in flight`` (both sides started on their GPUs and neither
    finished: the pair is stuck together), ``unstarted`` (the peer's started and waits, the stalled
    side's own call never started on its GPU: the stalled side holds the pair up) or ``done``."""
    calls = trace.calls
    rows = trace.rows_of(peer)
    own = calls[rows]
    matching = Op.RECV if int(row["op"]) == Op.SEND else Op.SEND
    mine = (own["comm"] == row["comm"]) & (own["op"] == matching) & (own["peer"] == row["comm_rank"])
    if not np.any(own["seq"][mine] >= row["seq"]):
        return "missing"
    exact = np.flatnonzero(mine & (own["seq"] == row["seq"]))
    if not len(exact):
        return "done"
    at = rows.start + int(exact[0])
    if queued[at]:
        return "queued"
    timed = calls["gpu_start"][rows].any() and calls["gpu_start"][trace.rows_of(int(row["rank"]))].any()
    if completion_known and calls["t_return"][at] == 0 and timed:
        if calls["gpu_start"][at] == 0:
            return "queued"
        return "in flight" if int(row["gpu_start"]) > 0 else "unstarted"
    return "done"


def _stuck_pair_culprits(
    waits_for: dict[int, set[int]], stuck_pairs: set[frozenset[int]]
) -> tuple[set[int], list[frozenset[int]]]:
    """Of each send/receive pair stuck together, the side the other ranks' waits lead to when nobody
    waits on the other side; else the pair, undecided (both sides hold others up)."""
    culprits, undecided = set(), []
    for pair in sorted(stuck_pairs, key=sorted):
        behind = _roots_behind(waits_for, set(pair))
        holding = [rank for rank in pair if behind.get(rank)]
        if len(holding) == 1:
            culprits.add(holding[0])
        else:
            undecided.append(pair)
    return culprits, undecided


def _held_up_together(trace: Trace, ranks: set[int], waiting: set[int], members_of: dict[int, set[int]]) -> set[int]:
    """Of ``ranks``, those in a communicator whose members all stopped at the same collective: every member
    left records, each one's last call there is the same instance, over for all of them, and none waits
    in any call. A rank that stops on its own leaves the other members of its communicators to go on to
    the next collective they share with it and wait there for it; members that all stopped together at
    one call are held up from outside (in a send/receive the source does not record), not each stopped."""
    calls = trace.calls
    together: set[int] = set()
    for comm_id, members in members_of.items():
        if len(members) < 2 or not members & ranks or members & waiting or not members <= set(trace.ranks):
            continue
        last = set()
        for member in members:
            own = calls[trace.rows_of(member)]
            own = own[(own["comm"] == comm_id) & ~is_p2p(own["op"])]
            if not len(own) or own[-1]["t_return"] == 0:
                break
            last.add(int(own["seq"].max()))
        else:
            if len(last) == 1:
                together |= members & ranks
    return together


def _stuck_pair_finding(trace: Trace, pair: frozenset[int], stalled: np.ndarray) -> Finding:
    """One finding for a send/receive whose two sides both started on their GPUs and never ended."""
    ranks = sorted(pair)
    rows = stalled[np.isin(stalled["rank"], ranks) & is_p2p(stalled["op"])]
    comm_id = int(rows[0]["comm"]) if len(rows) else 0
    return Finding(
        kind="hang",
        ranks=ranks,
        nodes=sorted({trace.node_of(r) for r in ranks}),
        communicator=comm_label(comm_id),
        confidence=0.4,
        summary=(
            f"a send/receive between {' and '.join(trace.label(r) for r in ranks)} never completed: both "
            "sides' GPU work started and neither ended, and both hold up other ranks; the traces cannot "
            "tell which side is stuck"
        ),
        evidence={"seq": int(rows[0]["seq"]) if len(rows) else None, "members_inside": ranks, "stuck": True},
    )


def _stalled_long_enough(
    trace: Trace, roots: dict[int, set[int]], end: int, stall_seconds: float
) -> dict[int, set[int]]:
    """The stopped ranks whose evidence runs on past their last call by the stall threshold: a rank
    whose records (or everyone's) simply end a moment after its last call has not been seen to stop."""
    kept = {}
    for culprit, waiters in roots.items():
        own = trace.calls[trace.rows_of(culprit)]
        last = int(max(own["t_call"].max(), own["t_return"].max())) if len(own) else 0
        if end - last >= stall_seconds * 1e9:
            kept[culprit] = waiters
    return kept


def _without_records(trace: Trace, members_of: dict[int, set[int]]) -> set[int]:
    """Ranks the job has (communicator members, or below the layout's world size) that left no record:
    stopped before they could dump, or their dump was lost."""
    known = set().union(*members_of.values()) if members_of else set()
    if trace.layout is not None:
        known |= set(range(trace.layout.world_size))
    return known - set(trace.ranks)


def _stopped_between_calls(
    trace: Trace,
    undumped: set[int],
    stalled: np.ndarray,
    entered: dict[tuple[int, int], set[int]],
    members_of: dict[int, set[int]],
) -> set[int]:
    """Of the ranks without records, those the others' records show stopped outside any collective: every
    other member of a communicator entered a collective there and waits for the rank alone, and such a
    member's call just before it was a collective the rank shares that was over (so the rank entered and
    left it too). Running the same program, the rank's next call was the awaited one, which it never
    made: it stopped between the two. Only where no send/receive can hold a rank unseen (none recorded,
    none the source leaves out)."""
    calls = trace.calls
    if trace.unrecorded_partners or is_p2p(calls["op"]).any():
        return set()
    proven = set()
    for row in stalled:
        rank, comm_id, seq = int(row["rank"]), int(row["comm"]), int(row["seq"])
        members = members_of.get(comm_id, set())
        missing = members - entered.get((comm_id, seq), set())
        if len(missing) != 1 or not missing <= undumped or not members - missing <= set(trace.ranks):
            continue
        own = calls[trace.rows_of(rank)]
        at = np.flatnonzero((own["comm"] == comm_id) & (own["seq"] == seq))
        if not len(at) or at[0] == 0:
            continue
        before = own[at[0] - 1]
        if before["t_return"] != 0 and next(iter(missing)) in members_of.get(int(before["comm"]), set()):
            proven |= missing
    return proven


def _undecided_stop_finding(candidates: set[int], waits_for: dict[int, set[int]], undumped: set[int]) -> Finding:
    """A stop the records cannot pin on one rank: several ranks are awaited in collectives they never
    entered, and each may be inside a send/receive the source does not record with another of them, or
    several ranks left no records at all."""
    ranks = sorted(candidates)
    waiting = sorted(rank for rank, targets in waits_for.items() if targets & candidates and rank not in candidates)
    if len(undumped) > 1 and undumped <= candidates:
        summary = (
            f"the job stopped: ranks {', '.join(map(str, waiting))} wait for ranks that left no records "
            f"({', '.join(map(str, sorted(undumped)))}): a rank that stopped before it could dump and one whose "
            "dump was lost look the same, so which one stopped is not localisable"
        )
    else:
        summary = (
            f"the job stopped: ranks {', '.join(map(str, ranks))} never entered collectives their peers wait in, "
            "and each may be waiting for another of them in a send/receive the dumps do not record (gloo): "
            "which one stopped is not localisable; NCCL's flight recorder records sends and receives"
        )
    return Finding(
        kind="hang",
        ranks=[],
        nodes=[],
        communicator=None,
        confidence=0.3,
        summary=summary,
        evidence={"candidates": ranks, "waiting_ranks": waiting, "without_records": sorted(undumped)},
    )


def _unless_across_nodes(trace: Trace, members: list[int]) -> list[int]:
    """``members`` when they share one node, else none: naming a whole group that spans nodes would
    cordon the healthy nodes with the stuck one."""
    return members if len({trace.node_of(rank) for rank in members}) == 1 else []


def detect_hangs(trace: Trace, stall_seconds: float = 1.0, now_ns: int | None = None) -> list[Finding]:
    """``now_ns``: the time the trace is judged at (default: until when its sources watched the job,
    ``Trace.observed_until_ns``, else the wall clock, so a live ring's in-flight calls are young and
    a dead job's are old). A wait, and a stop, must last ``stall_seconds`` before that time."""
    calls = trace.calls
    if not len(calls):
        return []
    if now_ns is None:
        now_ns = trace.observed_until_ns if trace.observed_until_ns is not None else time.time_ns()
    end = max(trace.end_ns, now_ns)
    completion_known = trace.has_returns or trace.pending_known
    findings = _detect(trace, stall_seconds, end, completion_known)
    if not completion_known:  # call times only (Megatrace): hosts ran ahead of their GPUs there too
        findings = _pinned_on_their_ranks(trace, findings)
    if not findings and completion_known and not trace.pending_known and not (calls["gpu_start"] > 0).any():
        # Rings without GPU times: on an asynchronous GPU every call returns at once, so a hang leaves
        # no call in flight (the hosts block in a synchronisation instead). Who stopped calling is
        # what survives: judged as call times alone are.
        findings = _detect(trace, stall_seconds, end, completion_known=False)
        findings = _pinned_on_their_ranks(trace, findings)
    return findings


def _pinned_on_their_ranks(trace: Trace, findings: list[Finding]) -> list[Finding]:
    """Of the hangs found from who stopped calling on a GPU that runs behind its host, those whose
    ranks' stop is their own: a host blocked in a synchronisation stopped for its GPU, which waits for
    someone the call times do not show (sync_points.py)."""
    named = sorted({rank for finding in findings for rank in finding.ranks})
    waiting = not_culprits(trace, named)
    kept = [finding for finding in findings if waiting.isdisjoint(finding.ranks)]
    if findings and not kept:
        return [_unlocalised_hang(findings)]
    return kept


def _unlocalised_hang(dropped: list[Finding]) -> Finding:
    """A hang whose stopped ranks all blocked in a synchronisation: reported, naming nobody."""
    stopped = sorted({rank for finding in dropped for rank in finding.ranks})
    return Finding(
        kind="hang",
        ranks=[],
        nodes=[],
        communicator=None,
        confidence=0.3,
        summary=(
            f"the job stopped: rank(s) {', '.join(map(str, stopped))} stopped calling NCCL while others went on, "
            "but each stopped where its host waits for its GPU (a synchronisation); which GPU holds the job up "
            "is not localisable from call times; enable GPU timing"
        ),
        evidence={"stopped_at_sync": stopped},
    )


def _detect(trace: Trace, stall_seconds: float, end: int, completion_known: bool) -> list[Finding]:
    calls = trace.calls
    if completion_known:
        pending = calls["t_return"] == 0
    else:  # only call times: a rank's last call is where it stopped (or finished)
        ranks = calls["rank"]
        pending = np.empty(len(calls), bool)
        np.not_equal(ranks[1:], ranks[:-1], out=pending[:-1])
        pending[-1:] = True
    # GPU-timed calls queued behind their rank's own earlier call are not where it waits
    queued = _queued(calls, pending) if completion_known else np.zeros(len(calls), bool)
    waiting = np.flatnonzero(pending)  # few (a finished run: none): the tests on those only
    waiting = waiting[~queued[waiting]]
    stalled = calls[waiting[end - calls["t_call"][waiting] >= stall_seconds * 1e9]]
    if not len(stalled):
        return []

    entered, queued_in, left = _entered(trace, stalled, queued, completion_known)
    # A collective ends for all its members together: one whose instance a member left is over, whatever
    # another member's record of it still says (its GPU end not read yet, or lost).
    over = np.array([bool(left.get((c, q))) if o not in (Op.SEND, Op.RECV) else False
                     for c, q, o in zip(stalled["comm"].tolist(), stalled["seq"].tolist(), stalled["op"].tolist(),
                                        strict=True)], bool)  # fmt: skip
    if over.any():
        stalled = stalled[~over]
        if not len(stalled):
            return []
    progress_in: dict[int, dict[int, int]] = {}
    members_of = {comm_id: set(comm.members.values()) for comm_id, comm in trace.comms.items()}
    missing_in: dict[tuple[int, int], set[int]] = {}  # per instance: members that never entered it
    waits_for: dict[int, set[int]] = {}  # waiting rank -> ranks it waits for
    unknown_peer: set[int] = set()
    stuck: dict[tuple[int, int], np.ndarray] = {}  # collectives everyone entered and nobody left
    stuck_pairs: set[frozenset[int]] = set()  # sends/receives both sides started and neither left
    unstarted: set[int] = set()  # ranks whose send/receive never started on the GPU while the peer's did
    guessed: set[int] = set()  # ranks whose wait is a send/receive with an unnamed peer (Megatrace)
    for row in stalled:
        rank, comm_id, seq = int(row["rank"]), int(row["comm"]), int(row["seq"])
        comm = trace.comms.get(comm_id)
        if int(row["op"]) in (Op.SEND, Op.RECV):
            peer = comm.members.get(int(row["peer"])) if comm else None
            if peer is None:  # the source does not name the peer (Megatrace): whoever fell behind here
                behind = _behind_in(trace, comm, seq, progress_in) if comm else set()
                if behind:
                    waits_for.setdefault(rank, set()).update(behind)
                    guessed.add(rank)
                else:
                    unknown_peer.add(rank)  # waits for someone the trace does not name
                continue
            state = _p2p_match(trace, row, peer, queued, completion_known)
            if state in ("missing", "queued"):
                waits_for.setdefault(rank, set()).add(peer)
            elif state == "in flight":
                stuck_pairs.add(frozenset((rank, peer)))
            elif state == "unstarted":
                unstarted.add(rank)
            continue
        key = (comm_id, seq)
        if key not in missing_in:
            # a member whose call there waits behind its own earlier work has not reached it either
            missing_in[key] = (members_of.get(comm_id, set()) - entered.get(key, set())) | queued_in.get(key, set())
        if missing_in[key] - {rank}:
            waits_for.setdefault(rank, set()).update(missing_in[key] - {rank})
        elif completion_known and key not in stuck:  # without completion a finished job looks the same
            stuck[key] = stalled[(stalled["comm"] == comm_id) & (stalled["seq"] == seq)]

    waiting = set(stalled["rank"].tolist())
    in_unrecorded = _follow_unrecorded_partners(trace, waits_for, waiting, unknown_peer)
    stopped = {  # waits for nothing: it stopped outside NCCL
        rank
        for targets in waits_for.values()
        for rank in targets
        if rank not in waits_for and (not completion_known or (rank not in unknown_peer and rank not in waiting))
    }  # (a rank inside a collective everyone entered is reported as stuck below)
    pair_culprits, undecided_pairs = _stuck_pair_culprits(waits_for, stuck_pairs)
    stopped |= pair_culprits | (unstarted - set(waits_for))
    roots = _roots_behind(waits_for, stopped)
    if not roots and guessed and not completion_known:
        # Waits that only go round: a send/receive's unnamed peer was guessed as a member whose count
        # there is lower, but pipeline stages make different numbers of sends and receives. A rank that
        # others wait for in a collective it never entered is known to have stopped; the guess is dropped.
        awaited = {rank for missing in missing_in.values() for rank in missing}
        for rank in guessed & awaited:
            waits_for.pop(rank, None)
        stopped = {rank for targets in waits_for.values() for rank in targets if rank not in waits_for}
        roots = _roots_behind(waits_for, stopped)
    undecided_stop: set[int] = set()
    if not roots and in_unrecorded:
        # Guessed unrecorded exchanges that only go round (rank A in one with B, B with A): one of them
        # stopped and the other waits for it. The one others wait for in a recorded collective it never
        # entered is the stopped one when it is the only such rank; else the records cannot tell.
        awaited = {rank for missing in missing_in.values() for rank in missing} & in_unrecorded
        # ... unless its guessed exchange leads to a collective its members are stuck inside: it waits there
        inside = {int(rank) for rows in stuck.values() for rank in rows["rank"]}
        awaited -= {rank for waiters in _roots_behind(waits_for, inside).values() for rank in waiters}
        # ... and unless it stopped together with every member of one of its communicators: held up from outside
        alone = awaited - _held_up_together(trace, awaited, waiting, members_of)
        if len(alone) == 1:
            awaited = alone
        if len(awaited) == 1:
            waits_for.pop(next(iter(awaited)))
            roots = _roots_behind(waits_for, stopped | awaited)
        else:
            undecided_stop = awaited
    roots = _stalled_long_enough(trace, roots, end, stall_seconds)
    if not completion_known:
        _merge_stopped_together(trace, stalled, roots, members_of, stuck)
    undumped = _without_records(trace, members_of)
    if len(undumped) > 1 and undumped & set(roots):
        # Several ranks left no records: a stopped rank and a healthy one whose dump was lost look the
        # same, and every rank that waited for either is a root. Nobody can be named from these records,
        # but for a rank they place between two collectives of its own program.
        proven = _stopped_between_calls(trace, undumped & set(roots), stalled, entered, members_of)
        undecided_stop |= (set(roots) | undumped) if not proven else set()
        roots = {culprit: waiters for culprit, waiters in roots.items() if culprit in proven}

    findings = []
    for culprit, waiters in sorted(roots.items()):
        direct = [rank for rank in waits_for if culprit in waits_for[rank]]
        blocked = stalled[np.isin(stalled["rank"], direct)]
        verb = "never matched" if len(blocked) and int(blocked[0]["op"]) in (Op.SEND, Op.RECV) else "never entered"
        if not len(blocked):  # its direct waiters wait in unrecorded sends/receives: show a recorded wait
            blocked = stalled[np.isin(stalled["rank"], sorted(waiters))]
            verb = f"waits behind rank(s) {', '.join(map(str, direct))} that wait for"
        first = blocked[np.argmin(blocked["t_call"])]
        own = calls[trace.rows_of(culprit)]
        last = own[-1] if len(own) else None
        if last is not None:
            last_seen = int(max(last["t_return"], last["t_call"]))
            idle = (end - last_seen) / 1e9  # absolute times: a re-analysis reads the same, not "N s ago"
            last_text = (
                f"its last NCCL call was {_describe_call(last)}, at {utc_text(last_seen)}, "
                f"{idle:.1f} s before {utc_text(end)}"
            )
            if not completion_known:  # offline logs: how long they go on after it, not the wall clock
                after = (trace.end_ns - int(last["t_call"])) / 1e9
                last_text = f"its last NCCL call was {_describe_call(last)}; the logs end {after:.3f} s later"
        else:
            last_text = "it recorded no NCCL call at all"
        comm_id = int(first["comm"])
        relation = f"which {verb} rank {culprit}" if verb.startswith("waits") else f"which rank {culprit} {verb}"
        findings.append(
            Finding(
                kind="hang",
                ranks=[culprit],
                nodes=[trace.node_of(culprit)],
                communicator=comm_label(comm_id),
                # call times alone (Megatrace) cannot show the waiters are still inside their calls
                confidence=(0.95 if completion_known else 0.8) if last is not None else 0.7,
                summary=(
                    f"{trace.label(culprit)} stopped: {len(waiters)} rank(s) wait for it; "
                    f"rank {int(first['rank'])} waits in {_describe_call(first)} of {trace.comm_name(comm_id)}, "
                    f"{relation}; {last_text}"
                ),
                evidence={
                    "seq": int(first["seq"]),
                    "op": Op(int(first["op"])).name,
                    "waiting_ranks": sorted(waiters),
                    # since the waiter's GPU started the call when timed (its host may have called it far earlier)
                    "waiting_seconds": round((end - int(max(first["t_call"], first["gpu_start"]))) / 1e9, 3),
                    "culprit_calls": len(own),
                },
            )
        )

    findings += [_stuck_pair_finding(trace, pair, stalled) for pair in undecided_pairs if pair.isdisjoint(roots)]
    if undecided_stop:
        findings.append(_undecided_stop_finding(undecided_stop, waits_for, undumped))
    for (comm_id, seq), rows in stuck.items():
        if any(int(r) in roots for r in rows["rank"]):
            continue
        started = rows["gpu_start"] > 0
        inside = [r for r in rows["rank"].tolist() if (int(r), comm_id, seq) in trace.stuck_inside]
        if len(inside) == 1 and len(rows) > 1:
            culprits, confidence = inside, 0.9
            why = "its work there never ended, not even by timing out, while its peers' timed out"
        elif inside:  # in a larger gloo group, work waiting on the stuck member's neighbours may outlive it too
            culprits, confidence = [], 0.3
            why = f"the work of ranks {', '.join(map(str, sorted(inside)))} never ended there: not localisable"
        elif started.any() and not started.all():
            culprits, confidence = sorted(rows["rank"][~started].tolist()), 0.9
            why = "its GPU work never started while its peers' did"
        elif started.all():
            culprits, confidence = _unless_across_nodes(trace, sorted(rows["rank"].tolist())), 0.4
            why = "every member's GPU work started and none ended; the traces cannot tell which one is stuck"
            if not culprits:
                why += ": not localisable, nobody named (its members span several nodes)"
        elif trace.calls_block_on_host and trace.pending_known:
            # gloo's recorder: every member's work still in flight, none retired, says nothing of which is stuck
            culprits, confidence = [], 0.3
            why = (
                "all members entered and no member's work had ended when it dumped; gloo's recorder does not tell "
                "which one is stuck: not localisable"
            )
        else:
            culprits, confidence = sorted(rows["rank"].tolist()), 0.4
            how = "none returned" if completion_known else "none logged a call after it"
            why = f"all members entered and {how}; GPU timing or the flight recorder would tell which is stuck"
        findings.append(
            Finding(
                kind="hang",
                ranks=culprits,
                nodes=sorted({trace.node_of(r) for r in culprits}),
                communicator=comm_label(comm_id),
                confidence=confidence,
                summary=(
                    f"{_describe_call(rows[0])} of {trace.comm_name(comm_id)} never completed: "
                    f"{'; '.join(trace.label(r) for r in culprits) or f'one of its {len(rows)} members'} stuck "
                    f"inside it ({why})"
                ),
                evidence={"seq": seq, "members_inside": sorted(rows["rank"].tolist()), "stuck": True},
            )
        )
    return findings


def short_ends(trace: Trace, stall_seconds: float, now_ns: int | None = None, shown: int = 3) -> list[str]:
    """What a trace without a hang says of ranks whose records end short of their peers' in a
    communicator: behind, but not for the stall threshold (logs that simply end, or a live job)."""
    calls = trace.calls[is_collective(trace.calls["op"])]
    if not len(calls):
        return []
    if now_ns is None:
        now_ns = trace.observed_until_ns if trace.observed_until_ns is not None else time.time_ns()
    end = max(trace.end_ns, now_ns)
    pairs, inverse = np.unique(np.stack([calls["comm"], calls["rank"].astype(np.uint64)], axis=1), axis=0,
                               return_inverse=True)  # fmt: skip
    inverse = inverse.reshape(-1)
    last_seq = np.zeros(len(pairs), np.uint64)
    np.maximum.at(last_seq, inverse, calls["seq"])
    last_call = np.zeros(len(pairs), np.int64)
    np.maximum.at(last_call, inverse, calls["t_call"])
    lines: list[tuple[int, str]] = []
    for comm_id in np.unique(pairs[:, 0]).tolist():
        mine = pairs[:, 0] == comm_id
        ahead = int(last_seq[mine].max())
        for index in np.flatnonzero(mine & (last_seq < ahead)).tolist():
            rank = int(pairs[index, 1])
            own = trace.calls[trace.rows_of(rank)]
            after = (end - int(max(own["t_call"].max(), own["t_return"].max()))) / 1e9
            if after >= stall_seconds:
                continue  # a stop the hang detector judged
            lines.append((rank, (
                f"rank {rank}'s records end {ahead - int(last_seq[index])} call(s) short of its peers' in "
                f"{trace.comm_name(comm_id)}, {after * 1e3:.1f} ms before the evidence ends: less than the stall "
                f"threshold ({stall_seconds:g} s), so not a hang (the records simply end there)"
            )))  # fmt: skip
    # the ranks short in the most communicators first (a rank that stopped is short in each of its groups)
    short_in = Counter(rank for rank, _ in lines)
    lines.sort(key=lambda line: -short_in[line[0]])
    return [text for _, text in lines[:shown]]
