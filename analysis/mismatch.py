"""Mismatched collectives: at one sequence number of one communicator, ranks disagree on the operation,
the element count or the datatype (PyTorch's fr_trace: COLLECTIVE_TYPE_MISMATCH, SIZE_OR_SYNTAX_MISMATCH,
COLLECTIVE_DTYPE_MISMATCH). A code path taken on some ranks only: a software fault, not a node's.

The odd ranks are the minority of the ranks that recorded the instance. With no majority (one rank
against one), the communicators of the same kind decide: at the same sequence number they all run the
same code, so a call none of them makes there is the odd one. When that does not decide either, the
finding says who disagrees and names nobody.

Members whose records are missing (gloo aborts a rank that receives more bytes than it expected: the odd
rank's peer writes no dump) leave the odd rank alone in its instance. It is named when its communicator's
siblings decide (a strict majority of them make another call at that number), the instance is the last its
communicator recorded (where it stalled), and the communicator made the siblings' call at every earlier
number where they agreed (so it runs their program, not a stage's own by design).

Only what every source records alike is compared: a source that does not record a field (Megatrace:
no datatype) has it 0 on every rank. Instances where one rank recorded several calls under one
sequence number (coalesced collectives) are left out.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from rankwatch.analysis.findings import Cause, Finding, FindingKind, comm_label
from rankwatch.analysis.ring import Op
from rankwatch.analysis.stacks import caller_frame
from rankwatch.analysis.trace import COLLECTIVE_OPS, Trace

DTYPE_NAMES = {0: "int8", 1: "uint8", 2: "int32", 3: "uint32", 4: "int64", 5: "uint64", 6: "float16",
               7: "float32", 8: "float64", 9: "bfloat16", 10: "float8e4m3", 11: "float8e5m2"}  # fmt: skip
FIELDS = ("op", "count", "dtype")
UNEVEN_OPS = np.array([Op.ALLTOALL, Op.GATHER, Op.SCATTER], dtype=np.uint8)
CHECKS = {"op": "collective type", "count": "element count", "dtype": "datatype"}

Signature = tuple[int, int, int]  # op, count, dtype
LONE_HISTORY = 2
"""Earlier numbers at which a communicator with a lone odd call must have made its siblings' call."""


def describe(signature: Signature) -> str:
    op, count, dtype = signature
    name = Op(op).name.title().replace("_", "") if op in Op._value2member_map_ else f"op {op}"
    return f"{name} of {count:,} x {DTYPE_NAMES.get(dtype, f'datatype {dtype}')}"


def _instances(trace: Trace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The collectives sorted by (communicator, sequence, rank), the start of each instance in that
    order, and which instances are whole (no rank with two calls under one number)."""
    # Column by column, and only the six columns compared: copying whole records of millions of calls
    # twice (select, then sort) took 2.7 s of CPU at 8 M calls.
    collective = np.isin(trace.calls["op"], COLLECTIVE_OPS)
    columns = {name: trace.calls[name][collective] for name in ("comm", "seq", "rank", *FIELDS)}
    order = np.lexsort((columns["rank"], columns["seq"], columns["comm"]))
    calls = np.empty(len(order), dtype=[(name, trace.calls.dtype[name]) for name in columns])
    for name, column in columns.items():
        calls[name] = column[order]
    # uneven all-to-alls, gathers and scatters take inputs of different sizes on different ranks by design
    # (fr_trace leaves them undecided): only their op and datatype are compared
    calls["count"][np.isin(calls["op"], UNEVEN_OPS)] = 0
    if not len(calls):
        return calls, np.zeros(0, np.int64), np.zeros(0, bool)
    same_instance = (calls["comm"][1:] == calls["comm"][:-1]) & (calls["seq"][1:] == calls["seq"][:-1])
    starts = np.flatnonzero(np.r_[True, ~same_instance])
    repeated = np.r_[same_instance & (calls["rank"][1:] == calls["rank"][:-1]), False]
    whole = np.add.reduceat(repeated.astype(np.int64), starts) == 0
    return calls, starts, whole


def detect_mismatches(trace: Trace) -> list[Finding]:
    """One finding per communicator and set of odd ranks, at the first instance where they disagree."""
    calls, starts, whole = _instances(trace)
    if not len(calls):
        return []
    differs = np.zeros(len(starts), bool)
    for name in FIELDS:
        column = calls[name].astype(np.int64)
        differs |= np.minimum.reduceat(column, starts) != np.maximum.reduceat(column, starts)
    bad = np.flatnonzero(differs & whole)
    bounds = np.r_[starts, len(calls)]
    agreed = _agreed_signatures(calls, starts, whole & ~differs, trace)
    findings: dict[tuple[int, tuple[int, ...]], Finding] = {}
    for index, expected in _lone_odd_instances(calls, starts, whole & ~differs, agreed, trace):
        rows = calls[bounds[index] : bounds[index + 1]]
        comm_id, seq = int(rows[0]["comm"]), int(rows[0]["seq"])
        by_rank = {int(r["rank"]): (int(r["op"]), int(r["count"]), int(r["dtype"])) for r in rows}
        findings[(comm_id, tuple(sorted(by_rank)))] = _finding(trace, comm_id, seq, by_rank, sorted(by_rank),
                                                               "siblings", expected)  # fmt: skip
    for index in bad.tolist():
        rows = calls[bounds[index] : bounds[index + 1]]
        comm_id, seq = int(rows[0]["comm"]), int(rows[0]["seq"])
        by_rank = {int(r["rank"]): (int(r["op"]), int(r["count"]), int(r["dtype"])) for r in rows}
        odd, how = _odd_ranks(by_rank, agreed.get((_kind(trace, comm_id), seq), Counter()))
        key = (comm_id, tuple(odd))
        if key in findings:
            findings[key].evidence["instances"] += 1
            continue
        findings[key] = _finding(trace, comm_id, seq, by_rank, odd, how)
    return list(findings.values())


def _kind(trace: Trace, comm_id: int) -> tuple[str, int]:
    """What makes communicators siblings: the layout's group kind when known, and the size."""
    comm = trace.comms.get(comm_id)
    members = set(comm.members.values()) if comm else set()
    kind = trace.layout.group_kind(members) if trace.layout and members else "?"
    return kind, len(members)


def _agreed_signatures(
    calls: np.ndarray, starts: np.ndarray, agreeing: np.ndarray, trace: Trace
) -> dict[tuple[tuple[str, int], int], Counter[Signature]]:
    """(communicator kind, sequence) -> how many communicators of that kind agreed on each call there."""
    counted: dict[tuple[tuple[str, int], int], Counter[Signature]] = {}
    kinds: dict[int, tuple[str, int]] = {}
    for index in np.flatnonzero(agreeing).tolist():
        row = calls[starts[index]]
        comm_id = int(row["comm"])
        if comm_id not in kinds:
            kinds[comm_id] = _kind(trace, comm_id)
        signature = (int(row["op"]), int(row["count"]), int(row["dtype"]))
        counted.setdefault((kinds[comm_id], int(row["seq"])), Counter())[signature] += 1
    return counted


def _signature(row: np.void) -> Signature:
    return int(row["op"]), int(row["count"]), int(row["dtype"])


def _consensus(siblings: Counter[Signature]) -> Signature | None:
    """The call a strict majority of the sibling communicators made, if any."""
    if not siblings:
        return None
    top, votes = siblings.most_common(1)[0]
    return top if votes * 2 > sum(siblings.values()) else None


def _lone_odd_instances(
    calls: np.ndarray,
    starts: np.ndarray,
    agreeing: np.ndarray,
    agreed: dict[tuple[tuple[str, int], int], Counter[Signature]],
    trace: Trace,
) -> list[tuple[int, Signature]]:
    """(instance, the siblings' call) for each instance some members never recorded whose recorded members
    made a call the siblings do not make there, as the module says."""
    comm_of = calls["comm"][starts]
    sizes = np.diff(np.r_[starts, len(calls)])
    last = np.r_[comm_of[1:] != comm_of[:-1], True]  # sorted by communicator, then number
    found = []
    for index in np.flatnonzero(agreeing & last).tolist():
        comm = trace.comms.get(int(comm_of[index]))
        if comm is None or sizes[index] >= comm.size:
            continue
        kind = _kind(trace, comm.id)
        row = calls[starts[index]]
        expected = _consensus(agreed.get((kind, int(row["seq"])), Counter()))
        if expected is None or expected == _signature(row):
            continue
        earlier = np.flatnonzero((comm_of == comm.id) & agreeing)[:-1]
        matched = 0
        for before in earlier.tolist():
            first = calls[starts[before]]
            consensus = _consensus(agreed.get((kind, int(first["seq"])), Counter()))
            if consensus is not None and consensus != _signature(first):
                break
            matched += consensus is not None
        else:
            if matched >= LONE_HISTORY:
                found.append((index, expected))
    return found


def _odd_ranks(by_rank: dict[int, Signature], siblings: Counter[Signature]) -> tuple[list[int], str]:
    """The ranks whose call is the odd one, and what decided it (``majority``, ``siblings``, or
    ``undecided`` with nobody named)."""
    votes = Counter(by_rank.values())
    top, top_votes = votes.most_common(1)[0]
    if top_votes * 2 > len(by_rank):
        return sorted(rank for rank, signature in by_rank.items() if signature != top), "majority"
    seen = [signature for signature in votes if siblings.get(signature)]
    if len(seen) == 1 and siblings[seen[0]] * 2 > sum(siblings.values()):
        return sorted(rank for rank, signature in by_rank.items() if signature != seen[0]), "siblings"
    return [], "undecided"


def _finding(
    trace: Trace,
    comm_id: int,
    seq: int,
    by_rank: dict[int, Signature],
    odd: list[int],
    how: str,
    expected: Signature | None = None,
) -> Finding:
    """``expected``: the siblings' call, when the odd ranks' peers left no record of theirs."""
    signatures = set(by_rank.values())
    compared = signatures | ({expected} if expected else set())
    fields = [name for position, name in enumerate(FIELDS) if len({s[position] for s in compared}) > 1]
    disagree = " and ".join(CHECKS[name] for name in fields)
    calls = "; ".join(
        f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: {describe(signature)}"
        for signature, ranks in sorted(
            ((s, sorted(r for r, t in by_rank.items() if t == s)) for s in signatures), key=lambda item: item[1]
        )
    )
    where = f"#{seq} of {trace.comm_name(comm_id)}"
    comm = trace.comms.get(comm_id)
    unrecorded = sorted(set(comm.members.values()) - set(by_rank)) if comm else []
    if expected is not None:
        calls += f"; the communicators of the same kind: {describe(expected)}"
    if expected is not None:
        who = f"{', '.join(trace.label(rank) for rank in odd)} called another collective than its siblings"
        why = (f"no record of {', '.join(map(str, unrecorded))} at this number; the communicators of the same kind "
               "all make the other call there, and this one made their calls before")  # fmt: skip
    elif how == "majority":
        who = f"{', '.join(trace.label(rank) for rank in odd)} called another collective than its peers"
        why = "the others agree"
    elif how == "siblings":
        who = f"{', '.join(trace.label(rank) for rank in odd)} called another collective than its peer(s)"
        why = "the communicators of the same kind all make the other call at this number"
    else:
        who = "its members called different collectives"
        why = "nothing tells which side took the wrong code path: nobody named"
    frames = {}
    for rank, signature in by_rank.items():
        stack = trace.stacks.get((rank, comm_id, seq, signature[0]))
        frame = caller_frame(stack) if stack else None
        if frame is not None:
            frames[str(rank)] = {"file": frame.file, "line": frame.line, "function": frame.function}
    evidence: dict[str, object] = {
        "seq": seq,
        "mismatch": fields,
        "calls": {str(rank): describe(signature) for rank, signature in sorted(by_rank.items())},
        "decided_by": how,
        "instances": 1,
    }
    if expected is not None:
        evidence["siblings_call"] = describe(expected)
        evidence["unrecorded"] = unrecorded
    if frames:
        evidence["frames"] = frames
        culprit_frames = [frames[str(rank)] for rank in odd if str(rank) in frames]
        if culprit_frames:
            evidence["culprit_frame"] = culprit_frames[0]
    return Finding(
        kind=FindingKind.MISMATCH,
        ranks=odd,
        nodes=sorted({trace.node_of(rank) for rank in odd}),
        communicator=comm_label(comm_id),
        confidence={"majority": 0.95, "siblings": 0.85}.get(how, 0.5),
        summary=f"collective {where}: {who} ({disagree} differ{'s' if len(fields) == 1 else ''}: {calls}); {why}",
        evidence=evidence,
        cause=Cause.SOFTWARE,
        cause_evidence=f"ranks disagree on the {disagree} of one collective: a code path, not a node",
    )
