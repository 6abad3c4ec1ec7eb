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
from dataclasses import dataclass

import numpy as np

from rankwatch.analysis.findings import Cause, Finding, FindingKind, comm_label
from rankwatch.analysis.instances import Instances, instances_of
from rankwatch.analysis.ring import Op
from rankwatch.analysis.stacks import caller_frame
from rankwatch.analysis.trace import Trace, is_collective

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


@dataclass(frozen=True)
class _Collectives:
    """The collectives grouped into instances (members in rank order), with the compared fields of each
    call in that order: gathered once, column by column (copying whole records of millions of calls
    was what cost, and a three-key sort of them)."""

    instances: Instances
    rank: np.ndarray
    op: np.ndarray
    count: np.ndarray  # 0 for the uneven operations
    dtype: np.ndarray

    @property
    def starts(self) -> np.ndarray:
        return self.instances.starts[:-1]

    def by_rank(self, index: int) -> dict[int, Signature]:
        """Each member's call in one instance."""
        rows = slice(int(self.instances.starts[index]), int(self.instances.starts[index + 1]))
        columns = (
            self.rank[rows].tolist(),
            self.op[rows].tolist(),
            self.count[rows].tolist(),
            self.dtype[rows].tolist(),
        )
        return {rank: (op, count, dtype) for rank, op, count, dtype in zip(*columns, strict=True)}

    def signature(self, index: int) -> Signature:
        """The call of an instance's first member (every member's, in an instance they agree on)."""
        row = int(self.instances.starts[index])
        return int(self.op[row]), int(self.count[row]), int(self.dtype[row])


def _instances(trace: Trace) -> tuple[_Collectives, np.ndarray]:
    """The collectives and which instances are whole (no rank with two calls under one number)."""
    calls = trace.calls
    instances = instances_of(trace, is_collective(calls["op"]))
    rows = instances.rows
    op = calls["op"][rows]
    # uneven all-to-alls, gathers and scatters take inputs of different sizes on different ranks by design
    # (fr_trace leaves them undecided): only their op and datatype are compared
    count = calls["count"][rows]
    count[np.isin(op, UNEVEN_OPS)] = 0
    found = _Collectives(instances, calls["rank"][rows], op, count, calls["dtype"][rows])
    if not len(rows):
        return found, np.zeros(0, bool)
    repeated = np.zeros(len(rows), bool)
    np.equal(found.rank[1:], found.rank[:-1], out=repeated[1:])
    repeated[found.starts] = False
    return found, ~np.logical_or.reduceat(repeated, found.starts)


def detect_mismatches(trace: Trace) -> list[Finding]:
    """One finding per communicator and set of odd ranks, at the first instance where they disagree."""
    collectives, whole = _instances(trace)
    instances = collectives.instances
    if not len(instances):
        return []
    differs = np.zeros(len(instances), bool)
    for column in (collectives.op, collectives.count, collectives.dtype):
        differs |= np.minimum.reduceat(column, collectives.starts) != np.maximum.reduceat(column, collectives.starts)
    bad = np.flatnonzero(differs & whole)
    agreed = _agreed_signatures(collectives, whole & ~differs, trace)
    findings: dict[tuple[int, tuple[int, ...]], Finding] = {}
    for index, expected in _lone_odd_instances(collectives, whole & ~differs, agreed, trace):
        comm_id, seq = int(instances.comm[index]), int(instances.seq[index])
        by_rank = collectives.by_rank(index)
        findings[(comm_id, tuple(sorted(by_rank)))] = _finding(trace, comm_id, seq, by_rank, sorted(by_rank),
                                                               "siblings", expected)  # fmt: skip
    for index in bad.tolist():
        comm_id, seq = int(instances.comm[index]), int(instances.seq[index])
        by_rank = collectives.by_rank(index)
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
    collectives: _Collectives, agreeing: np.ndarray, trace: Trace
) -> dict[tuple[tuple[str, int], int], Counter[Signature]]:
    """(communicator kind, sequence) -> how many communicators of that kind agreed on each call there:
    one count of the distinct (kind, sequence, call) over the instances, the kinds decided per communicator."""
    instances = collectives.instances
    kinds: dict[tuple[str, int], int] = {}  # kind -> its index
    of_comm = [kinds.setdefault(_kind(trace, comm_id), len(kinds)) for comm_id in instances.comm_ids.tolist()]
    kind_of = list(kinds)
    chosen = np.flatnonzero(agreeing)
    firsts = instances.starts[chosen]
    columns = (np.array(of_comm, np.int64)[instances.comm_index[chosen]], instances.seq[chosen],
               collectives.op[firsts], collectives.count[firsts], collectives.dtype[firsts])  # fmt: skip
    order = np.lexsort(columns[::-1])
    columns = tuple(column[order] for column in columns)
    same = np.ones(len(order), bool)
    same[:1] = False
    for column in columns:
        same[1:] &= column[1:] == column[:-1]
    starts = np.flatnonzero(~same)
    votes = np.diff(np.r_[starts, len(order)])
    counted: dict[tuple[tuple[str, int], int], Counter[Signature]] = {}
    for kind, seq, op, count, dtype, n in zip(*(column[starts].tolist() for column in columns), votes.tolist(),
                                              strict=True):  # fmt: skip
        counted.setdefault((kind_of[kind], seq), Counter())[(op, count, dtype)] = n
    return counted


def _consensus(siblings: Counter[Signature]) -> Signature | None:
    """The call a strict majority of the sibling communicators made, if any."""
    if not siblings:
        return None
    top, votes = siblings.most_common(1)[0]
    return top if votes * 2 > sum(siblings.values()) else None


def _lone_odd_instances(
    collectives: _Collectives,
    agreeing: np.ndarray,
    agreed: dict[tuple[tuple[str, int], int], Counter[Signature]],
    trace: Trace,
) -> list[tuple[int, Signature]]:
    """(instance, the siblings' call) for each instance some members never recorded whose recorded members
    made a call the siblings do not make there, as the module says."""
    instances = collectives.instances
    comm_of, sizes = instances.comm, instances.sizes
    last = np.r_[comm_of[1:] != comm_of[:-1], True]  # sorted by communicator, then number
    found = []
    for index in np.flatnonzero(agreeing & last).tolist():
        comm = trace.comms.get(int(comm_of[index]))
        if comm is None or sizes[index] >= comm.size:
            continue
        kind = _kind(trace, comm.id)
        signature = collectives.signature(index)
        expected = _consensus(agreed.get((kind, int(instances.seq[index])), Counter()))
        if expected is None or expected == signature:
            continue
        own = slice(int(np.searchsorted(comm_of, comm_of[index])), index)  # the communicator's earlier instances
        matched = 0
        for before in (own.start + np.flatnonzero(agreeing[own])).tolist():
            consensus = _consensus(agreed.get((kind, int(instances.seq[before])), Counter()))
            if consensus is not None and consensus != collectives.signature(before):
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
