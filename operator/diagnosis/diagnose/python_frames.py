"""Where in Python the culprit is, against its peers: the stacks the sidecars took for their stall reports.

A hang's culprit never made its next NCCL call; its peers wait inside one. The stall report of each
pod carries its ranks' main-thread stacks (``RankPosition.python_stack``, py-spy), so the diagnosis
can say "rank 2 is at data/loader.py:88 __next__; ranks 0, 1, 3 at distributed_c10d.py:2501
all_reduce". The innermost frame is where a rank is; the rest of the stack is kept as evidence.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from rankwatch.model.finding import Cause, Finding, FindingKind
from rankwatch.operator.diagnosis.ingest.job_state import JobState

FRAMES_IN_EVIDENCE = 6
DATA_FRAMES_LOOKED_AT = 4
"""How deep into a culprit's stack (from where it is) a data or checkpoint frame counts: below that, the
function is the training loop that called it, not what the rank is waiting for."""
DATA_FUNCTION = re.compile(
    r"^(__next__|_next_data|_get_data|load_batch|get_batch|next_batch|load_checkpoint|save_checkpoint)$"
)
DATA_FILE = re.compile(
    r"(torch/utils/data/|dataloader|/datasets?/|dist_checkpointing/|checkpointing\.py|torch/serialization\.py)", re.I
)
"""Data loading and checkpoint files (not ``torch/utils/checkpoint.py``: activation recomputation is compute)."""


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
    found = dataclasses.replace(finding, summary=f"{finding.summary}. Python: {where}", evidence=evidence)
    reading = _data_frame(stacks[culprits[0]])
    peers_reading = any(_data_frame(frames) for rank, frames in stacks.items() if rank not in finding.ranks)
    if reading and found.cause is Cause.UNKNOWN and peers and not peers_reading:
        waiting = sum(len(ranks) for ranks in peers.values())
        found = dataclasses.replace(
            found,
            cause=Cause.DATA_STORAGE,
            cause_evidence=f"rank {culprits[0]} is in {reading}, reading data or a checkpoint, while its {waiting} "
            f"peer(s) with stacks are not",
        )
    return found


def _data_frame(frames: list[str]) -> str | None:
    """The first of the innermost frames that reads training data or a checkpoint (a frame is
    ``file:line function``), or None."""
    for frame in frames[:DATA_FRAMES_LOOKED_AT]:
        location, _, function = frame.rpartition(" ")
        if DATA_FUNCTION.match(function) or DATA_FILE.search(location):
            return frame
    return None
