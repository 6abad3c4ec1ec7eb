"""The writes that end an attempt and start the next one (blocking Kubernetes calls: run in a thread).

Order of a restart, each step safe to repeat after a crash: the evidence is archived (by the caller),
then the status moves to the next attempt (``restarts`` + 1, ``Pending``, ``Restarting`` True, the
ended attempt appended to ``attempts``, its finding made inactive, ``restartAfter`` = now + backoff)
in one conditional patch, then the ended attempt's pods are deleted; the next attempt's workers are
created once the backoff is over (``children.ensure_children``). The status moves first so that the
pod-driven status never reads the deleted pods as workers lost from a running job.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch.model.diagnosis_status import DiagnosisStatus, key_of
from rankwatch.model.finding import DEGRADED, HUNG
from rankwatch.operator import api, ownership
from rankwatch.operator.diagnosis.report.writer import SUSPECT_NODES_ANNOTATION, SUSPECT_RANKS_ANNOTATION
from rankwatch.operator.lifecycle import job_status
from rankwatch.operator.lifecycle.children import current_attempt
from rankwatch.operator.lifecycle.status_patch import update_status
from rankwatch.operator.recovery.decision import WORKER_FAILED, culprits_text
from rankwatch.timestamps import rfc3339, rfc3339_now

log = logging.getLogger(__name__)

END_GRACE_SECONDS = 10
"""A hung rank may not react to SIGTERM; its pod is killed this long after."""
MAX_ATTEMPTS_LISTED = 25


@dataclass(frozen=True)
class EndedAttempt:
    """One entry of ``status.attempts``: why an attempt ended, whom it blamed, where its evidence is."""

    attempt: int
    reason: str
    ranks: list[int]
    nodes: list[str]
    pods: list[str]
    summary: str
    endTime: str
    archive: str = ""
    archiveProblems: tuple[str, ...] = ()

    def as_status(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "attempt": self.attempt,
            "reason": self.reason,
            "ranks": self.ranks,
            "nodes": self.nodes,
            "pods": self.pods,
            "summary": self.summary,
            "endTime": self.endTime,
            "archive": self.archive,
        }
        if self.archiveProblems:
            entry["archiveProblems"] = list(self.archiveProblems)[:10]
        return entry

    @classmethod
    def of(cls, status: Mapping[str, Any], reason: str, moment: str) -> EndedAttempt:
        failure = status.get("workerFailure") or {}
        if reason == WORKER_FAILED and failure:
            return cls(
                attempt=current_attempt(status),
                reason=reason,
                ranks=[],
                nodes=list(failure.get("nodes") or []),
                pods=list(failure.get("pods") or []),
                summary=str(failure.get("message") or ""),
                endTime=moment,
            )
        diagnosis = DiagnosisStatus.from_status(status) or DiagnosisStatus(active=False, reason="")
        return cls(
            attempt=current_attempt(status),
            reason=reason,
            ranks=list(diagnosis.ranks),
            nodes=list(diagnosis.nodes),
            pods=list(diagnosis.pods),
            summary=diagnosis.summary,
            endTime=moment,
        )


def attempt_pods(
    kube: kubernetes.client.ApiClient, namespace: str, name: str, uid: str, attempt: int | None = None
) -> list[dict[str, Any]]:
    """The worker pods the job (``uid``) controls, of one attempt when given, as plain dicts.

    The labels only narrow the list; a pod is the job's through its controller reference, so a pod
    someone else labelled with the job's name is never archived from, ended nor counted."""
    selector = f"{api.JOB_NAME_LABEL}={name}"
    if attempt is not None:
        selector += f",{api.ATTEMPT_LABEL}={attempt}"
    pods = kubernetes.client.CoreV1Api(kube).list_namespaced_pod(namespace, label_selector=selector).items
    return [kube.sanitize_for_serialization(pod) for pod in pods if ownership.is_owned_by(pod.metadata, uid)]


def end_pods(kube: kubernetes.client.ApiClient, namespace: str, pods: list[dict[str, Any]]) -> list[str]:
    """Delete ``pods`` (already-gone ones are fine); returns the names asked to end."""
    core = kubernetes.client.CoreV1Api(kube)
    ended = []
    for pod in pods:
        name = pod["metadata"]["name"]
        if pod["metadata"].get("deletionTimestamp"):
            continue
        try:
            core.delete_namespaced_pod(name, namespace, grace_period_seconds=END_GRACE_SECONDS)
            ended.append(name)
        except ApiException as error:
            if error.status != 404:
                raise
    return ended


def nodes_to_avoid(kube: kubernetes.client.ApiClient, nodes: list[str]) -> list[str]:
    """The suspect nodes that scheduling does not already exclude (not cordoned: dry run, breaker
    open, opt-out, per-job limit): the next attempt gets a node anti-affinity for these."""
    core = kubernetes.client.CoreV1Api(kube)
    avoid = []
    for node in nodes:
        try:
            if not core.read_node(node).spec.unschedulable:
                avoid.append(node)
        except ApiException as error:
            if error.status != 404:  # a node that is gone needs no avoiding
                avoid.append(node)
    return avoid


def _clear_suspect_annotations(kube: kubernetes.client.ApiClient, namespace: str, name: str) -> None:
    kubernetes.client.CustomObjectsApi(kube).patch_namespaced_custom_object(
        api.GROUP, api.VERSION, namespace, api.PLURAL, name,
        {"metadata": {"annotations": {SUSPECT_NODES_ANNOTATION: None, SUSPECT_RANKS_ANNOTATION: None}}},
    )  # fmt: skip


def _finding_closed(status: Mapping[str, Any], why: str, moment: str, generation: int) -> dict[str, Any]:
    """Status fields that close the active finding and reset Hung/Degraded for the next attempt."""
    diagnosis = DiagnosisStatus.from_status(status)
    conditions = list(status.get("conditions") or [])
    for type_ in (HUNG, DEGRADED):
        conditions = job_status.set_condition(
            conditions, type_, "Unknown", "AwaitingTelemetry", f"{why}; no trace summaries analysed yet", moment,
            generation,
        )  # fmt: skip
    return {
        "conditions": conditions,
        # a job without a diagnosis (a worker failed) gets an inactive, empty one, resolved now
        **(diagnosis or DiagnosisStatus(active=False, reason="")).resolved(moment).to_status(),
        "health": "Unknown",
        "suspects": "",
        "handledDiagnosis": key_of(diagnosis),
    }


def write_restart(
    kube: kubernetes.client.ApiClient,
    namespace: str,
    name: str,
    expected_key: str,
    ended: EndedAttempt,
    avoid: list[str],
    backoff_s: int,
    reason: str,
) -> dict[str, Any] | None:
    """Move the job to its next attempt (see the module docstring); None when the job moved on meanwhile
    (another writer handled this finding, or it ended)."""
    moment = datetime.datetime.now(datetime.UTC)
    stamp = rfc3339(moment)

    def change(job: dict[str, Any]) -> dict[str, Any] | None:
        status = job.get("status") or {}
        if status.get("phase") in job_status.TERMINAL or not _still(status, expected_key, ended.attempt):
            return None
        generation = job["metadata"].get("generation", 1)
        attempt = ended.attempt + 1
        message = f"attempt {ended.attempt} ended ({reason}); attempt {attempt} starts"
        if backoff_s:
            message += f" after a {backoff_s} s backoff"
        if avoid:
            message += f", kept off {', '.join(avoid)}"
        fields = _finding_closed(status, f"attempt {ended.attempt} ended ({reason})", stamp, generation)
        conditions = job_status.set_condition(
            fields["conditions"], "Restarting", "True", reason, message, stamp, generation
        )
        conditions = job_status.set_condition(conditions, "Running", "False", "Restarting", message, stamp, generation)
        attempts = [*(status.get("attempts") or []), ended.as_status()][-MAX_ATTEMPTS_LISTED:]
        fields.update(
            phase=job_status.PENDING,
            message=message,
            conditions=conditions,
            restarts=attempt,
            attempts=attempts,
            avoidNodes=sorted({*(status.get("avoidNodes") or []), *avoid}),
            restartAfter=rfc3339(moment + datetime.timedelta(seconds=backoff_s)),
            workerFailure=None,
            workers=f"0/{job['spec'].get('replicas', 1)}",
        )
        return fields

    written = update_status(namespace, name, change, kube=kube)
    if written is None:
        return None
    job, _ = written
    _clear_suspect_annotations(kube, namespace, name)
    return job


def write_failed(
    kube: kubernetes.client.ApiClient,
    namespace: str,
    name: str,
    expected_key: str,
    ended: EndedAttempt,
    limit_note: str,
) -> dict | None:
    """maxRestarts reached: Failed, naming the culprits of every attempt."""
    stamp = rfc3339_now()

    def change(job: dict[str, Any]) -> dict[str, Any] | None:
        status = job.get("status") or {}
        if status.get("phase") in job_status.TERMINAL or not _still(status, expected_key, ended.attempt):
            return None
        generation = job["metadata"].get("generation", 1)
        attempts = [*(status.get("attempts") or []), ended.as_status()][-MAX_ATTEMPTS_LISTED:]
        message = f"RestartLimitReached: {limit_note}; culprits: {culprits_text(attempts)}"
        conditions = list(status.get("conditions") or [])
        for type_, value in (("Failed", "True"), ("Running", "False"), ("Restarting", "False")):
            conditions = job_status.set_condition(
                conditions, type_, value, "RestartLimitReached", message, stamp, generation
            )
        return {
            "phase": job_status.FAILED,
            "message": message,
            "conditions": conditions,
            "attempts": attempts,
            "completionTime": stamp,
            "handledDiagnosis": key_of(DiagnosisStatus.from_status(status)),
        }

    written = update_status(namespace, name, change, kube=kube)
    return written[0] if written else None


def write_handled(
    kube: kubernetes.client.ApiClient, namespace: str, name: str, expected_key: str
) -> dict[str, Any] | None:
    """Dry run / policy None: remember that this finding was dealt with (said and archived)."""

    def change(job: dict[str, Any]) -> dict[str, Any] | None:
        status = job.get("status") or {}
        if status.get("handledDiagnosis") == expected_key:
            return None
        return {"handledDiagnosis": expected_key}

    written = update_status(namespace, name, change, kube=kube)
    return written[0] if written else None


def write_archived(kube: kubernetes.client.ApiClient, namespace: str, name: str, entry: dict[str, Any]) -> None:
    """Append to ``status.archives`` (every archive kept, by attempt)."""

    def change(job: dict[str, Any]) -> dict[str, Any] | None:
        archives = list((job.get("status") or {}).get("archives") or [])
        if entry in archives:
            return None
        return {"archives": [*archives, entry][-MAX_ATTEMPTS_LISTED:]}

    update_status(namespace, name, change, kube=kube)


def _still(status: Mapping[str, Any], expected_key: str, attempt: int) -> bool:
    """The job still carries the finding this step was decided on, in the same attempt."""
    diagnosis = DiagnosisStatus.from_status(status)
    if current_attempt(status) != attempt:
        return False
    if expected_key == WORKER_FAILED:
        return (status.get("workerFailure") or {}).get("attempt") == attempt
    return diagnosis is not None and diagnosis.active and diagnosis.key == expected_key
