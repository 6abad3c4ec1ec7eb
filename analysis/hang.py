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

import numpy as np

from rankwatch.analysis.findings import Finding, comm_label
from rankwatch.analysis.ring import Op
from rankwatch.analysis.trace import P2P_OPS, Trace


def _describe_call(row: np.void) -> str:
    return f"{Op(int(row['op'])).name.title().replace('_', '')} #{int(row['seq'])}"


def detect_hangs(trace: Trace, stall_seconds: float = 1.0, now_ns: int | None = None) -> list[Finding]:
    """``now_ns``: the time the trace is judged at (default: the wall clock, so a live ring's
    in-flight calls are young and a dump of a dead job's calls are old)."""
    calls = trace.calls
    if not len(calls):
        return []
    end = max(trace.end_ns, now_ns if now_ns is not None else time.time_ns())
    if trace.has_returns:
        pending = calls["t_return"] == 0
    else:  # only call times: a rank's last call is where it stopped (or finished)
        pending = np.zeros(len(calls), bool)
        pending[np.flatnonzero(np.diff(calls["rank"], append=np.int64(2**40)))] = True
    stalled = calls[pending & (end - calls["t_call"] >= stall_seconds * 1e9)]
    if not len(stalled):
        return []

    entered: dict[tuple[int, int], set[int]] = {}  # (comm, seq) -> ranks that entered it (collectives)
    collectives = calls[~np.isin(calls["op"], P2P_OPS)]
    for comm_id in np.unique(stalled["comm"]):
        mine = collectives[collectives["comm"] == comm_id]
        for seq in np.unique(stalled[(stalled["comm"] == comm_id)]["seq"]):
            entered[(int(comm_id), int(seq))] = set(mine[mine["seq"] == seq]["rank"].tolist())

    waits_for: dict[int, set[int]] = {}  # waiting rank -> ranks it waits for
    unknown_peer: set[int] = set()
    stuck: dict[tuple[int, int], np.ndarray] = {}  # collectives everyone entered and nobody left
    for row in stalled:
        rank, comm_id, seq = int(row["rank"]), int(row["comm"]), int(row["seq"])
        comm = trace.comms.get(comm_id)
        members = set(comm.members.values()) if comm else set()
        if int(row["op"]) in (Op.SEND, Op.RECV):
            peer = comm.members.get(int(row["peer"])) if comm else None
            if peer is None:
                unknown_peer.add(rank)  # waits for someone the trace does not name
                continue
            matching = Op.RECV if int(row["op"]) == Op.SEND else Op.SEND
            peer_calls = calls[(calls["rank"] == peer) & (calls["comm"] == comm_id) & (calls["op"] == matching)]
            if not np.any(peer_calls["seq"][peer_calls["peer"] == row["comm_rank"]] >= seq):
                waits_for.setdefault(rank, set()).add(peer)
            continue
        missing = members - entered.get((comm_id, seq), set())
        if missing:
            waits_for.setdefault(rank, set()).update(missing)
        elif trace.has_returns:  # without return times a finished job looks the same: say nothing
            stuck[(comm_id, seq)] = stalled[(stalled["comm"] == comm_id) & (stalled["seq"] == seq)]

    waiting = set(stalled["rank"].tolist())
    roots: dict[int, set[int]] = {}  # culprit -> ranks whose wait leads to it
    for start in waits_for:
        seen, frontier = {start}, list(waits_for[start])
        while frontier:
            rank = frontier.pop()
            if rank in seen:
                continue
            seen.add(rank)
            if rank in waits_for:
                frontier.extend(waits_for[rank])  # it waits too: follow its wait
            elif rank in unknown_peer:
                continue  # waits in a send/receive whose peer the source did not log
            elif rank not in waiting or not trace.has_returns:
                roots.setdefault(rank, set()).add(start)  # waits for nothing: it stopped
            # else: it is inside a collective everyone entered: reported as stuck below

    findings = []
    for culprit, waiters in sorted(roots.items()):
        direct = [rank for rank in waits_for if culprit in waits_for[rank]]
        blocked = stalled[np.isin(stalled["rank"], direct)]
        first = blocked[np.argmin(blocked["t_call"])]
        verb = "never matched" if int(first["op"]) in (Op.SEND, Op.RECV) else "never entered"
        own = calls[calls["rank"] == culprit]
        last = own[-1] if len(own) else None
        if last is not None:
            idle = (end - int(max(last["t_return"], last["t_call"]))) / 1e9
            last_text = f"its last NCCL call was {_describe_call(last)}, {idle:.1f} s ago"
        else:
            last_text = "it recorded no NCCL call at all"
        comm_id = int(first["comm"])
        findings.append(
            Finding(
                kind="hang",
                ranks=[culprit],
                nodes=[trace.node_of(culprit)],
                communicator=comm_label(comm_id),
                # call times alone (Megatrace) cannot show the waiters are still inside their calls
                confidence=(0.95 if trace.has_returns else 0.8) if last is not None else 0.7,
                summary=(
                    f"{trace.label(culprit)} stopped: {len(waiters)} rank(s) wait for it; "
                    f"rank {int(first['rank'])} waits in {_describe_call(first)} of {trace.comm_name(comm_id)}, "
                    f"which rank {culprit} {verb}; {last_text}"
                ),
                evidence={
                    "seq": int(first["seq"]),
                    "op": Op(int(first["op"])).name,
                    "waiting_ranks": sorted(waiters),
                    "waiting_seconds": round((end - int(first["t_call"])) / 1e9, 3),
                    "culprit_calls": len(own),
                },
            )
        )

    for (comm_id, seq), rows in stuck.items():
        if any(int(r) in roots for r in rows["rank"]):
            continue
        started = rows["gpu_start"] > 0
        if started.any() and not started.all():
            culprits, confidence = sorted(rows["rank"][~started].tolist()), 0.9
            why = "its GPU work never started while its peers' did"
        else:
            culprits, confidence = sorted(rows["rank"].tolist()), 0.4
            why = "all members entered and none returned; GPU timing or the flight recorder would tell which is stuck"
        findings.append(
            Finding(
                kind="hang",
                ranks=culprits,
                nodes=sorted({trace.node_of(r) for r in culprits}),
                communicator=comm_label(comm_id),
                confidence=confidence,
                summary=(
                    f"{_describe_call(rows[0])} of {trace.comm_name(comm_id)} never completed: "
                    f"{'; '.join(trace.label(r) for r in culprits)} stuck inside it ({why})"
                ),
                evidence={"seq": seq, "members_inside": sorted(rows["rank"].tolist()), "stuck": True},
            )
        )
    return findings
