"""Python frames as evidence: where in the training script the culprit (or its waiters) made the call.

Flight-recorder dumps carry each call's Python stack (innermost first: torch.distributed's own
frames, then the caller's). A finding gets the first frame outside torch of the culprit's call in
the finding's communicator (``culprit_frame``: file, line, function), and for a hang also of the call
its peers wait in (``waiting_frame``), which is all there is when the culprit left no dump.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from rankwatch.analysis.findings import Finding
from rankwatch.analysis.trace import Frame, Trace

LIBRARY_PARTS = ("/torch/", "/site-packages/torch", "/dist-packages/torch")


def caller_frame(frames: tuple[Frame, ...]) -> Frame | None:
    """The innermost frame that is not torch's own (the line of the training code that called)."""
    for frame in frames:
        if frame.file and not any(part in frame.file for part in LIBRARY_PARTS):
            return frame
    return frames[0] if frames else None


def _as_evidence(frame: Frame) -> dict[str, object]:
    return {"file": frame.file, "line": frame.line, "function": frame.function}


def _most_common(trace: Trace, ranks: set[int], comm: int | None, seq: int | None = None) -> Frame | None:
    frames = Counter(
        frame
        for (rank, comm_id, call_seq, _), stack in trace.stacks.items()
        if rank in ranks and (comm is None or comm_id == comm) and (seq is None or call_seq == seq)
        if (frame := caller_frame(stack)) is not None
    )
    return frames.most_common(1)[0][0] if frames else None


def add_frames(trace: Trace, findings: list[Finding]) -> None:
    """Adds ``culprit_frame`` / ``waiting_frame`` to the findings' evidence where the trace has stacks."""
    if not trace.stacks:
        return
    for finding in findings:
        if finding.kind == "mismatch":  # carries the frames of the very calls that disagree
            continue
        comm = int(finding.communicator, 16) if finding.communicator else None
        if finding.kind == "hang":
            seq = finding.evidence.get("seq")
            waiting = set(finding.evidence.get("waiting_ranks", ()))
            culprit = _latest(trace, set(finding.ranks))
            waiter = _most_common(trace, waiting, comm, seq)
            if culprit:
                finding.evidence["culprit_frame"] = _as_evidence(culprit)
            if waiter:
                finding.evidence["waiting_frame"] = _as_evidence(waiter)
        else:
            culprit = _most_common(trace, set(finding.ranks), comm)
            if culprit:
                finding.evidence["culprit_frame"] = _as_evidence(culprit)


def _latest(trace: Trace, ranks: set[int]) -> Frame | None:
    """The frame of the last recorded call of these ranks: where a stuck rank is."""
    rows = trace.calls[np.r_[tuple(trace.rows_of(rank) for rank in sorted(ranks))]] if ranks else trace.calls[:0]
    if not len(rows):
        return None
    last = rows[rows["t_call"].argmax()]
    stack = trace.stacks.get((int(last["rank"]), int(last["comm"]), int(last["seq"]), int(last["op"])))
    return caller_frame(stack) if stack else None
