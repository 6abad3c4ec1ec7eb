"""Restart a group of another kind away from its suspects with the kind's own lever, once per diagnosis.

The safeguards are a TrainingJob's (``recovery/decision.py``): only a finding its recovery would end an
attempt for (a confirmed hang by default; never a mismatch, whose cause is the job's own code), only
when the diagnosis names a node and every named node was cordoned (the cordon is what keeps the new
pods off it: rankwatch cannot add a node anti-affinity to a template it does not own), not in a dry run
or with ``rankwatch.io/recovery: None``, within the restart limit (the kind's own where it has one), and
only after the diagnosis's follow-ups are done (looked at once no diagnosis of the group is under way).

Once per diagnosis: the outcome goes into the diagnosis record on the owner (``restart``), claimed
(``pending: ...``) before the lever is pulled, so a second look, another replica or a new leader never
pulls it twice (an operator that dies between the claim and the pull loses that restart; the page was
sent). A refusal is recorded too (``not restarted: why``) with a Normal ``RestartSkipped`` Event; a
pull the API server refused with a Warning ``RestartFailed``. A restart closes the finding (the next
attempt starts clean) and posts a Warning ``Restarting`` Event on the owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import enum
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch.model.diagnosis_status import DiagnosisStatus
from rankwatch.model.finding import Cause
from rankwatch.operator import events
from rankwatch.operator.kinds.adapter import read_owner
from rankwatch.operator.kinds.group_record import GroupRecord, diagnosis_of
from rankwatch.operator.kinds.lever import LeverRefused, Pulled, RestartLever
from rankwatch.operator.kinds.restart_indexed_job import INDEXED_JOB_LEVER
from rankwatch.operator.kinds.restart_jobset import JOBSET_LEVER
from rankwatch.operator.kinds.restart_pytorchjob import PYTORCHJOB_LEVER
from rankwatch.operator.kinds.restart_trainjob import TRAINJOB_LEVER
from rankwatch.operator.kinds.restart_volcano import VOLCANO_LEVER
from rankwatch.operator.recovery.decision import counts
from rankwatch.operator.spec import TrainingJobSpec

log = logging.getLogger(__name__)

PATIENCE_S = 600.0
"""How long a restart waits for the group's diagnosis, its cordon and its alert to be recorded, and
retries a look the API server failed."""
RETRY_S = 5.0


class Action(enum.Enum):
    NOTHING = "nothing"  # not a finding a restart is for, or handled already
    WAIT = "wait"  # not yet: the cordon is not recorded
    SKIP = "skip"  # a restart is called for but not safe: cordon and page only, said on the owner
    RESTART = "restart"


@dataclass(frozen=True)
class Verdict:
    action: Action
    message: str = ""


def verdict(diagnosis: DiagnosisStatus | None, spec: TrainingJobSpec, unschedulable: Mapping[str, bool]) -> Verdict:
    """The safeguards shared by every kind (pure): ``unschedulable``, each named node's state now."""
    if diagnosis is None or not diagnosis.active or not diagnosis.time or diagnosis.restart:
        return Verdict(Action.NOTHING)
    if not diagnosis.remediation:
        return Verdict(Action.WAIT, "the cordon comes first")
    if diagnosis.cause is Cause.SOFTWARE or not counts(spec, diagnosis, None):
        return Verdict(Action.NOTHING)  # as a TrainingJob: this finding does not end an attempt
    nodes = list(diagnosis.nodes)
    if not nodes:
        return Verdict(Action.SKIP, "the diagnosis names no node to restart away from")
    if not spec.recovery.restarts:
        return Verdict(Action.SKIP, f"recovery policy is {spec.recovery.policy}")
    if spec.remediation.dryRun:
        return Verdict(Action.SKIP, "dry run: would restart the group away from " + ", ".join(nodes))
    uncordoned = [node for node in nodes if not unschedulable.get(node, False)]
    if uncordoned:
        return Verdict(
            Action.SKIP,
            f"{', '.join(uncordoned)} not cordoned ({diagnosis.remediation}): the new pods could land there",
        )
    return Verdict(Action.RESTART)


def unschedulable(kube: kubernetes.client.ApiClient, nodes: list[str]) -> dict[str, bool]:
    """Each node's ``spec.unschedulable`` now; a node that is gone keeps no pod: counted as cordoned."""
    core = kubernetes.client.CoreV1Api(kube)
    states = {}
    for node in nodes:
        try:
            states[node] = bool(core.read_node(node).spec.unschedulable)
        except ApiException as error:
            if error.status != 404:
                raise
            states[node] = True
    return states


LEVERS: dict[str, RestartLever] = {
    "Job": INDEXED_JOB_LEVER,
    "JobSet": JOBSET_LEVER,
    "VolcanoJob": VOLCANO_LEVER,
    "TrainJob": TRAINJOB_LEVER,
    "PyTorchJob": PYTORCHJOB_LEVER,
}


def lever_of(kind_key: str) -> RestartLever | None:
    """The lever of the kind rankwatch names ``kind_key``; None: cordon and page only."""
    return LEVERS.get(kind_key)


def _event(record: GroupRecord, type_: str, reason: str, message: str, time_: str) -> None:
    try:
        events.post_event(record.kube, record.group.event_target, type=type_, reason=reason, message=message,
                          key=f"restart/{reason}/{time_}", repeat=False,
                          now=datetime.datetime.now(datetime.UTC))  # fmt: skip
    except ApiException as error:
        log.warning("Event %s on %s not posted: HTTP %s", reason, record.group, error.status)


def restart_once(record: GroupRecord, spec: TrainingJobSpec) -> Pulled | Action | None:
    """Look at the diagnosis the group's owner carries and restart the group if it calls for it and
    nothing restarted it for this diagnosis yet; what was pulled, ``Action.WAIT`` when the diagnosis's
    cordon is not recorded yet, None when nothing was pulled. Blocking."""
    owner = read_owner(record.kube, record.group)
    if owner is None:
        return None
    diagnosis = diagnosis_of(owner)
    decided = verdict(diagnosis, spec, unschedulable(record.kube, list(diagnosis.nodes) if diagnosis else []))
    if decided.action is Action.NOTHING or diagnosis is None:
        return None
    if decided.action is Action.WAIT:
        return Action.WAIT
    time_ = diagnosis.time
    lever, pods, why = lever_of(record.group.kind_key), [], decided.message
    if decided.action is Action.RESTART:
        if lever is None:
            why = f"{record.group.kind_key} has no restart lever rankwatch pulls"
        else:
            pods = record.pods()
            why = lever.refusal(record.kube, owner, diagnosis, pods, spec) or ""
    if why or lever is None:
        if record.claim_restart(time_, f"not restarted: {why}; cordon and page only"):
            log.info("%s: not restarted: %s", record.group, why)
            _event(record, "Normal", "RestartSkipped", f"not restarted away from the suspects: {why}", time_)
        return None
    if not record.claim_restart(time_, f"pending: {type(lever).__name__}"):
        return None  # another look claimed it
    try:
        owner = read_owner(record.kube, record.group)  # as the claim left it (its resourceVersion)
        if owner is None:
            raise LeverRefused(f"{record.group} is gone")
        pulled = lever.pull(record.kube, record.group, owner, diagnosis, pods, spec)
    except (LeverRefused, ApiException) as error:
        text = str(error) if isinstance(error, LeverRefused) else f"HTTP {error.status} {error.reason}"
        record.settle_restart(time_, f"failed: {text}", closed=False)
        log.warning("%s: restart failed: %s", record.group, text)
        _event(record, "Warning", "RestartFailed", f"restart away from the suspects failed: {text}", time_)
        return None
    record.settle_restart(time_, pulled.done, closed=True)
    message = f"{diagnosis.reason} on {', '.join(diagnosis.nodes)} (cordoned): {pulled.done}"
    log.warning("%s: restarting: %s", record.group, message)
    _event(record, "Warning", "Restarting", message, time_)
    return pulled


class GroupRestarts:
    """Runs ``restart_once`` for a group once no diagnosis of it is under way; one task per group."""

    def __init__(self) -> None:
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}

    def schedule(self, record: GroupRecord, spec: TrainingJobSpec, monitor: Any) -> None:
        key = (record.group.namespace, record.group.collector_name)
        task = self._tasks.get(key)
        if task is not None and not task.done():
            return  # it reads the owner when it runs: what made this call is seen then
        self._tasks[key] = asyncio.create_task(self._run(key, record, spec, monitor), name=f"restart {record.group}")

    async def _run(self, key: tuple[str, str], record: GroupRecord, spec: TrainingJobSpec, monitor: Any) -> None:
        deadline = time.monotonic() + PATIENCE_S
        while time.monotonic() < deadline:
            if monitor.diagnosing(*key):  # its follow-ups (cordon, alert) are recorded first
                await asyncio.sleep(1.0)
                continue
            if not monitor.leading():
                return
            try:
                outcome = await asyncio.to_thread(restart_once, record, spec)
            except Exception:  # nothing was claimed: look again a little later
                log.exception("%s: restart away from the suspects failed; retrying", record.group)
                outcome = Action.WAIT
            if isinstance(outcome, Pulled):
                monitor.new_attempt(*key, set(outcome.ended_pods))
            if outcome is not Action.WAIT:
                return
            await asyncio.sleep(RETRY_S)
        log.warning("%s: its diagnosis's cordon was not recorded within %.0f s; not restarted", record.group,
                    PATIENCE_S)  # fmt: skip

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
