"""Where in Python the culprit is, against its peers: the stacks the sidecars took for their stall reports.

A hang's culprit never made its next NCCL call; its peers wait inside one. The stall report of each
pod carries its ranks' main-thread stacks (``RankPosition.python_stack``, py-spy), so the diagnosis
can say "rank 2 is at data/loader.py:88 __next__; ranks 0, 1, 3 at distributed_c10d.py:2501
all_reduce". The innermost frame is where a rank is; the rest of the stack is kept as evidence.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from rankwatch.analysis.findings import Finding, FindingKind
from rankwatch.operator.diagnosis.job_state import JobState

FRAMES_IN_EVIDENCE = 6


def latest_stacks(state: JobState, since: float) -> dict[int, list[str]]:
    """Each rank's most recent Python stack among the job's stall reports received from ``since`` on
    (operator monotonic time: an earlier episode's stacks say nothing of this one)."""
    stacks: dict[int, list[str]] = {}
    for received, report in state.stalls:  # oldest first: later reports overwrite
        if received < since:
            continue
        for position in report.positions:
            if position.python_stack:
                stacks[position.global_rank] = position.python_stack
    return stacks


def with_python_stacks(finding: Finding, stacks: dict[int, list[str]]) -> Finding:
    """A hang ``finding`` with the culprits' and peers' innermost frames in its summary and their stacks
    in its evidence; unchanged when no culprit's stack is known (or for other kinds: stacks are taken
    when a rank stalls)."""
    culprits = [rank for rank in finding.ranks if rank in stacks] if finding.kind is FindingKind.HANG else []
    if not culprits:
        return finding
    peers: dict[str, list[int]] = defaultdict(list)
    for rank, frames in sorted(stacks.items()):
        if rank not in finding.ranks and frames:
            peers[frames[0]].append(rank)
    where = "; ".join(f"rank {rank} is at {stacks[rank][0]}" for rank in culprits)
    if peers:
        where += "; " + "; ".join(
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} at {frame}"
            for frame, ranks in sorted(peers.items(), key=lambda item: -len(item[1]))
        )
    evidence = {
        **finding.evidence,
        "python_stacks": {str(rank): frames[:FRAMES_IN_EVIDENCE] for rank, frames in sorted(stacks.items())},
    }
    return dataclasses.replace(finding, summary=f"{finding.summary}. Python: {where}", evidence=evidence)
