"""A TrainingJob's status, derived from its worker pods: phase, counts, conditions, transitions.

Pure: given the pods and the previous status it returns the next status and the Events the
transition deserves, so the rules are unit-tested without a cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rankwatch.model import event_reasons
from rankwatch.operator import api, ownership
from rankwatch.operator.spec import TrainingJobSpec

PENDING, RUNNING, SUCCEEDED, FAILED = "Pending", "Running", "Succeeded", "Failed"
SUSPENDED = "Suspended"
"""``spec.suspend`` is true: the job has no worker pods (those of a running job are being deleted)."""
TERMINAL = (SUCCEEDED, FAILED)
CONDITION_TYPES = (
    "Created",
    "Suspended",
    "Running",
    "Restarting",
    "Succeeded",
    "Failed",
    "Hung",
    "Degraded",
    "NoTelemetry",
)
UNSCHEDULABLE = "Unschedulable"
GATED = "SchedulingGated"
"""The pod has scheduling gates: a queue (Kueue) has not admitted it yet."""
AWAITING_ADMISSION = "AwaitingAdmission"
STARTING = ("ContainerCreating", "PodInitializing")
"""Container waiting reasons of a pod on its way up; every other waiting reason is a problem."""
WAITING_MESSAGE_MAX_CHARS = 300


@dataclass(frozen=True)
class WorkerPod:
    """What the status needs to know of one worker pod."""

    name: str
    index: int
    phase: str
    ready: bool
    node: str | None
    deleting: bool
    problem: str  # why it failed or cannot start; empty when none
    attempt: int = 0
    owner_uid: str = ""
    """The uid of the TrainingJob that controls the pod (a pod with only the job's label: "")."""
    problem_reason: str = ""
    """The Kubernetes reason behind ``problem`` when the pod cannot start: ``Unschedulable``, or a
    container's waiting reason (``ImagePullBackOff``, ``CrashLoopBackOff``, ...)."""

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any]) -> WorkerPod:
        metadata, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        conditions = {c.get("type"): c for c in status.get("conditions") or []}
        ready = conditions.get("Ready", {}).get("status") == "True"
        problem = problem_reason = ""
        if status.get("phase") == FAILED:
            problem = _termination(status) or status.get("reason") or "failed"
        elif spec.get("schedulingGates"):
            # Held back before scheduling, by an admission queue (Kueue's gate until the whole gang is
            # admitted) or another controller: not a scheduling failure, and no node or GPU is held.
            gates = ", ".join(str(gate.get("name")) for gate in spec["schedulingGates"])
            problem, problem_reason = f"waiting for admission (scheduling gates: {gates})", GATED
        elif conditions.get("PodScheduled", {}).get("status") == "False":
            scheduled = conditions["PodScheduled"]
            problem = f"{scheduled.get('reason', 'Unschedulable')}: {scheduled.get('message', '')}".strip()
            problem_reason = UNSCHEDULABLE
        elif waiting := _waiting(status):
            problem_reason, problem = waiting
        labels = metadata.get("labels") or {}
        try:
            index = int(labels.get(api.REPLICA_INDEX_LABEL, "-1"))
        except ValueError:
            index = -1
        try:
            attempt = int(labels.get(api.ATTEMPT_LABEL, "0"))
        except ValueError:
            attempt = -1
        return cls(
            name=metadata["name"],
            index=index,
            phase=status.get("phase") or PENDING,
            ready=ready,
            node=spec.get("nodeName"),
            deleting=bool(metadata.get("deletionTimestamp")),
            problem=problem,
            attempt=attempt,
            owner_uid=ownership.controller_uid(metadata),
            problem_reason=problem_reason,
        )

    @property
    def container_problem(self) -> bool:
        """A container of this pod cannot start or keeps failing (not a scheduling problem)."""
        return bool(self.problem_reason) and self.problem_reason not in (UNSCHEDULABLE, GATED)


def _waiting(status: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, problem) of the first container (init containers and the sidecar first, as they run)
    that waits for a reason other than starting: an image that cannot be pulled, a crash loop, a
    missing ConfigMap or Secret (the kubelet's own words, shortened)."""
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason") or ""
        if reason and reason not in STARTING:
            message = " ".join(str(waiting.get("message") or "").split())
            if len(message) > WAITING_MESSAGE_MAX_CHARS:
                message = message[: WAITING_MESSAGE_MAX_CHARS - 1] + "…"
            return reason, f"container {container.get('name')} {reason}" + (f": {message}" if message else "")
    return None


def _termination(status: Mapping[str, Any]) -> str:
    for container in status.get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated")
        if terminated and terminated.get("exitCode", 0) != 0:
            reason = terminated.get("reason") or "Error"
            return f"container {container.get('name')} exited with code {terminated['exitCode']} ({reason})"
    return ""


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


def set_condition(
    conditions: list[dict[str, Any]], type_: str, status: str, reason: str, message: str, now: str, generation: int
) -> list[dict[str, Any]]:
    """Return ``conditions`` with ``type_`` set; lastTransitionTime moves only when status changes."""
    result = [dict(c) for c in conditions if c.get("type") != type_]
    previous = next((c for c in conditions if c.get("type") == type_), None)
    changed = previous is None or previous.get("status") != status
    result.append(
        {
            "type": type_,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": now if changed else previous.get("lastTransitionTime", now),
            "observedGeneration": generation,
        }
    )
    order = {name: position for position, name in enumerate(CONDITION_TYPES)}
    return sorted(result, key=lambda c: order.get(c["type"], len(order)))


def initial_conditions(spec: TrainingJobSpec, now: str, generation: int) -> list[dict[str, Any]]:
    """Conditions of a job whose children were just created."""
    conditions: list[dict[str, Any]] = []
    if spec.suspend:
        message = "spec.suspend is true: the job has no worker pods"
        conditions = set_condition(conditions, "Suspended", "True", SUSPENDED, message, now, generation)
    created = "Service created; no worker pods while suspended" if spec.suspend else "worker pods and Service created"
    conditions = set_condition(conditions, "Created", "True", "ChildrenCreated", created, now, generation)
    if spec.tracing.enabled:
        reason, message = "AwaitingTelemetry", "no trace summaries analysed yet"
    else:
        reason, message = (
            "TracingDisabled",
            "spec.tracing.enabled is false: rankwatch cannot see this job's collectives",
        )
    for type_ in ("Hung", "Degraded"):
        conditions = set_condition(conditions, type_, "Unknown", reason, message, now, generation)
    return conditions


def _restarts_on_worker_failure(spec: TrainingJobSpec, previous: Mapping[str, Any]) -> bool:
    """``spec.recovery`` restarts the job when a worker fails, and restarts are left."""
    recovery = spec.recovery
    return (
        recovery.restarts
        and recovery.restartOn.workerFailure
        and not spec.remediation.dryRun
        and int(previous.get("restarts") or 0) < recovery.maxRestarts
    )


STEADY_REASONS = (
    "WorkersPending",
    "AllWorkersRunning",
    "WorkersUnschedulable",
    "WorkerFailedRestarting",
    AWAITING_ADMISSION,
)


REASON_FAMILIES = {"ErrImagePull": "ImagePullBackOff"}
"""Waiting reasons the kubelet alternates between for one problem: one Event for both."""


def _family(reason: str | None) -> str | None:
    return REASON_FAMILIES.get(reason or "", reason)


def _by_index(pod: WorkerPod) -> int:
    return pod.index


def _more(pods: list[WorkerPod]) -> str:
    return f" (and {len(pods) - 1} more)" if len(pods) > 1 else ""


def _describe(pod: WorkerPod) -> str:
    where = f" on node {pod.node}" if pod.node else ""
    return f"worker {pod.index} (pod {pod.name}{where})"


def derive(
    spec: TrainingJobSpec, pods: list[WorkerPod], previous: Mapping[str, Any], now: str, generation: int
) -> tuple[dict[str, Any], list[Event]]:
    """The next status of a job and the Events for what changed since ``previous``."""
    old_phase = previous.get("phase") or PENDING
    if old_phase in TERMINAL:
        return dict(previous), []  # a finished job's verdict never changes

    attempt = int(previous.get("restarts") or 0)
    if spec.suspend:
        return _suspended(spec, pods, previous, now, generation)
    live = [pod for pod in pods if not pod.deleting and pod.attempt == attempt]  # earlier attempts' pods are ending
    counts = {
        "pending": sum(pod.phase == PENDING for pod in live),
        "running": sum(pod.phase == RUNNING for pod in live),
        "succeeded": sum(pod.phase == SUCCEEDED for pod in live),
        "failed": sum(pod.phase == FAILED for pod in live),
        "missing": max(0, spec.replicas - len(live)),
    }
    failed = sorted((pod for pod in live if pod.phase == FAILED), key=lambda pod: pod.index)
    if failed:
        phase, reason = FAILED, "WorkerFailed"
        message = f"{_describe(failed[0])} failed: {failed[0].problem}"
        if len(failed) > 1:
            message += f" (and {len(failed) - 1} more)"
    elif counts["succeeded"] == spec.replicas:
        phase, reason, message = SUCCEEDED, "AllWorkersSucceeded", f"all {spec.replicas} workers completed"
    elif counts["missing"] and old_phase == RUNNING:
        missing = sorted({*range(spec.replicas)} - {pod.index for pod in live})
        phase, reason = FAILED, "WorkerLost"
        message = f"worker(s) {', '.join(map(str, missing))} disappeared while the job was running"
    elif not counts["missing"] and counts["pending"] == 0 and counts["running"] > 0:
        phase, reason = RUNNING, "AllWorkersRunning"
        message = f"{spec.replicas} workers x {spec.nprocPerNode} ranks = world size {spec.world_size}"
        # Running pods whose containers crash-loop (restartPolicy OnFailure) or whose sidecar cannot start.
        stuck = sorted((pod for pod in live if pod.phase == RUNNING and pod.container_problem), key=_by_index)
        if stuck:
            reason = stuck[0].problem_reason
            message += f"; {_describe(stuck[0])}: {stuck[0].problem}" + _more(stuck)
    else:
        phase, reason = PENDING, "WorkersPending"
        blocked = sorted((pod for pod in live if pod.phase == PENDING and pod.problem), key=_by_index)
        waiting = counts["pending"] + counts["missing"]
        message = f"waiting for {waiting} of {spec.replicas} workers to start"
        if blocked:
            # A container's reason names itself (ImagePullBackOff, CreateContainerConfigError, ...).
            if blocked[0].container_problem:
                reason = blocked[0].problem_reason
            elif all(pod.problem_reason == GATED for pod in blocked):
                reason = AWAITING_ADMISSION  # the queue admits the gang whole: nothing runs, nothing to warn of
            else:
                reason = "WorkersUnschedulable"
            message += f"; {_describe(blocked[0])}: {blocked[0].problem}" + _more(blocked)

    status: dict[str, Any] = dict(previous)
    if phase == FAILED and _restarts_on_worker_failure(spec, previous):
        # Recovery ends this attempt and starts the next (it reads workerFailure); the job goes on.
        lost = failed or [pod for pod in pods if pod.attempt == attempt]
        status["workerFailure"] = {
            "attempt": attempt,
            "reason": reason,
            "message": message,
            "pods": sorted(pod.name for pod in lost)[:32],
            "nodes": sorted({pod.node for pod in failed if pod.node})[:32],
        }
        phase, reason = old_phase, "WorkerFailedRestarting"
    status.update(
        phase=phase,
        reason=reason,
        message=message,
        replicaStatuses=counts,
        workers=f"{sum(pod.ready and pod.phase == RUNNING for pod in live)}/{spec.replicas}",
        observedGeneration=generation,
    )
    status.setdefault("health", "Unknown")
    if phase == RUNNING and "startTime" not in status:
        status["startTime"] = now
    if phase in TERMINAL:
        status["completionTime"] = now

    conditions = list(previous.get("conditions") or [])
    if old_phase == SUSPENDED:
        conditions = set_condition(
            conditions,
            "Suspended",
            "False",
            "Resumed",
            "spec.suspend is false: workers are made again",
            now,
            generation,
        )
    conditions = set_condition(
        conditions, "Running", "True" if phase == RUNNING else "False", reason, message, now, generation
    )
    if phase in TERMINAL:
        conditions = set_condition(conditions, phase, "True", reason, message, now, generation)
    restarting = next((c for c in conditions if c["type"] == "Restarting"), None)
    if restarting and restarting["status"] == "True" and phase != PENDING:
        done = f"attempt {attempt}: {message}"
        conditions = set_condition(conditions, "Restarting", "False", reason, done, now, generation)
    status["conditions"] = conditions

    events: list[Event] = []
    if old_phase == SUSPENDED:
        events.append(Event("Normal", event_reasons.RESUMED, f"spec.suspend is false: {message}"))
    elif phase != old_phase:
        kind = "Warning" if phase == FAILED else "Normal"
        events.append(Event(kind, reason, message))
    elif reason == "WorkersUnschedulable" and previous.get("message") != message:
        events.append(Event("Warning", reason, message))
    elif reason not in STEADY_REASONS and _family(previous.get("reason")) != _family(reason):
        # A worker's container cannot start or keeps failing: once per reason (a back-off's message
        # changes with every retry, and a failing pull alternates ErrImagePull and ImagePullBackOff).
        events.append(Event("Warning", reason, message))
    return status, events


def _suspended(
    spec: TrainingJobSpec, pods: list[WorkerPod], previous: Mapping[str, Any], now: str, generation: int
) -> tuple[dict[str, Any], list[Event]]:
    """The status of a job with ``spec.suspend``: no workers wanted; those left are counted until gone."""
    remaining = sorted(pod.name for pod in pods)
    message = "spec.suspend is true: the job has no worker pods"
    if remaining:
        message = f"spec.suspend is true: {len(remaining)} worker pod(s) being deleted"
    status: dict[str, Any] = dict(previous)
    status.update(
        phase=SUSPENDED,
        reason=SUSPENDED,
        message=message,
        replicaStatuses={"pending": 0, "running": 0, "succeeded": 0, "failed": 0, "missing": spec.replicas},
        workers=f"0/{spec.replicas}",
        observedGeneration=generation,
    )
    status.setdefault("health", "Unknown")
    conditions = list(previous.get("conditions") or [])
    conditions = set_condition(conditions, "Suspended", "True", SUSPENDED, message, now, generation)
    conditions = set_condition(conditions, "Running", "False", SUSPENDED, message, now, generation)
    status["conditions"] = conditions
    old_phase = previous.get("phase") or PENDING
    events = [Event("Normal", SUSPENDED, message)] if old_phase != SUSPENDED else []
    return status, events
