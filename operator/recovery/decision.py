"""What recovery does about a job as it is now (pure: the job's spec and status in, a verdict out).

Level-triggered: the verdict is computed from the status alone, so an operator restarted at any point
decides the same again, and a finding already acted on (``status.handledDiagnosis``) is not acted on
twice. A restart makes the finding inactive (the next attempt starts clean), so an active finding
always belongs to the current attempt.
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rankwatch.model.diagnosis_status import DiagnosisStatus
from rankwatch.model.finding import FindingKind
from rankwatch.operator.spec import TrainingJobSpec

HUNG_KINDS = (FindingKind.HANG,)  # Hang and StuckInCollective
SLOWDOWN_KINDS = (FindingKind.STRAGGLER, FindingKind.FAIL_SLOW)
TERMINAL = ("Succeeded", "Failed")
WORKER_FAILED = "WorkerFailed"


class Action(enum.Enum):
    NOTHING = "nothing"
    WAIT = "wait"  # a hang that may still hold its GPUs a while (abortHungAfterSeconds)
    RESTART = "restart"  # archive, end the attempt, start the next one away from the suspects
    FAIL = "fail"  # archive, end the attempt, Failed: maxRestarts reached
    RECORD = "record"  # dry run or policy None: archive and say what a restart would have done
    ARCHIVE_FINAL = "archive_final"  # the job ended: keep what the sidecars still serve


@dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str = ""
    """The finding kind (``Hang``, ...) or ``WorkerFailed``; the job's phase for ``ARCHIVE_FINAL``."""
    message: str = ""
    not_before: datetime.datetime | None = None


def parse_time(value: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))


def counts(spec: TrainingJobSpec, diagnosis: DiagnosisStatus, slowdown: float | None) -> bool:
    """Does this finding end the attempt under ``spec.recovery.restartOn``?"""
    restart_on = spec.recovery.restartOn
    kind = diagnosis.kind
    if kind in HUNG_KINDS:
        return restart_on.hang
    if kind in SLOWDOWN_KINDS and restart_on.slowdownAbove is not None:
        return slowdown is not None and slowdown >= restart_on.slowdownAbove
    return False


def decide(
    spec: TrainingJobSpec,
    status: Mapping[str, Any],
    now: datetime.datetime,
    slowdown: float | None = None,
    archived_final: bool = False,
) -> Verdict:
    """The verdict for a job. ``slowdown``: the active finding's measured slowdown (straggler or
    fail-slow), when known; ``archived_final``: the job's end was archived already."""
    phase = status.get("phase")
    if phase in TERMINAL:
        if spec.tracing.archive is not None and not archived_final:
            return Verdict(Action.ARCHIVE_FINAL, reason=str(phase))
        return Verdict(Action.NOTHING)
    restarts = int(status.get("restarts") or 0)
    failure = status.get("workerFailure") or {}
    if failure.get("attempt") == restarts:  # the pod-driven status leaves it only when a restart is due
        return Verdict(Action.RESTART, WORKER_FAILED, f"restart {restarts + 1} of at most {spec.recovery.maxRestarts}")
    diagnosis = DiagnosisStatus.from_status(status)
    if diagnosis is None or not diagnosis.active or status.get("handledDiagnosis") == diagnosis.key:
        return Verdict(Action.NOTHING)
    if not counts(spec, diagnosis, slowdown):
        return Verdict(Action.NOTHING)
    kind = diagnosis.reason
    recovery = spec.recovery
    if diagnosis.kind in HUNG_KINDS and recovery.abortHungAfterSeconds and diagnosis.time:
        due = parse_time(diagnosis.time) + datetime.timedelta(seconds=recovery.abortHungAfterSeconds)
        if now < due:
            return Verdict(Action.WAIT, kind, f"the hang may keep its GPUs until {due.isoformat()}", due)
    if not recovery.restarts:
        return Verdict(Action.RECORD, kind, "spec.recovery.policy is None: the attempt is left as it is")
    if spec.remediation.dryRun:
        return Verdict(Action.RECORD, kind, f"dry run: would end attempt {restarts} and restart away from the suspects")
    if restarts >= recovery.maxRestarts:
        return Verdict(Action.FAIL, kind, f"{restarts} restart(s) of at most {recovery.maxRestarts} used")
    return Verdict(Action.RESTART, kind, f"restart {restarts + 1} of at most {recovery.maxRestarts}")


def culprits_text(attempts: list[Mapping[str, Any]]) -> str:
    """Every ended attempt's culprits, for the Failed message: ``attempt 0: Hang, rank 2 on gpu-node-1; ...``."""
    parts = []
    for attempt in attempts:
        ranks = ", ".join(str(rank) for rank in attempt.get("ranks") or []) or "none named"
        nodes = ", ".join(attempt.get("nodes") or []) or "no node named"
        parts.append(f"attempt {attempt.get('attempt')}: {attempt.get('reason')}, rank(s) {ranks} on {nodes}")
    return "; ".join(parts)
