"""Write a diagnosis onto the TrainingJob, record its follow-ups, and clear it when the job recovers.

What a person sees: ``status.diagnosis``, the ``Hung`` / ``Degraded`` condition with reason and
message, ``status.health`` and ``status.suspects`` (printer columns), the annotations
``rankwatch.io/suspect-nodes`` / ``suspect-ranks``, a Warning Event whose message names rank, node and
the numbers, and the full report (JSON + text, and the finding itself) in a ConfigMap the job owns.

Everything is recorded on the job, never only in memory, so that a restarted operator or a new
leader neither repeats nor loses anything: "already reported" is read from the status; the Event is
named after the diagnosis (posting it again finds it); ``status.diagnosis.remediation`` and
``alertedTime`` say which follow-ups are done. Blocking (the Kubernetes client): call these in a
worker thread. Status patches carry the resourceVersion they were computed from, so a concurrent
writer (the pod-status sync) means recompute, never overwrite.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch.model import event_reasons
from rankwatch.model.diagnosis_status import DiagnosisStatus, FollowUp
from rankwatch.model.evidence import node_alert_lines
from rankwatch.model.finding import DEGRADED, HUNG, Finding
from rankwatch.operator import api, events
from rankwatch.operator.diagnosis.diagnose.diagnose import Diagnosis
from rankwatch.operator.lifecycle import job_status
from rankwatch.operator.lifecycle.status_patch import update_status

log = logging.getLogger(__name__)

SUSPECT_NODES_ANNOTATION = "rankwatch.io/suspect-nodes"
SUSPECT_RANKS_ANNOTATION = "rankwatch.io/suspect-ranks"
REPORT_MAX_BYTES = 512 << 10
"""The report ConfigMap stays well under the 1 MiB object limit; longer reports are cut, saying so."""
MAX_LISTED = 32
REMEDIATION, ALERTED = FollowUp.REMEDIATION, FollowUp.ALERTED


def report_configmap_name(job_name: str) -> str:
    return f"{job_name}-rankwatch-report"


def listed(values: list[Any]) -> str:
    text = ",".join(map(str, values[:MAX_LISTED]))
    return text + (f",+{len(values) - MAX_LISTED}" if len(values) > MAX_LISTED else "")


def same_diagnosis(previous: DiagnosisStatus | None, diagnosis: Diagnosis) -> bool:
    """The job already carries this finding (active, same condition, same culprit ranks)."""
    if previous is None or not previous.active:
        return False
    return (
        previous.condition == diagnosis.finding.condition
        and sorted(previous.ranks) == sorted(diagnosis.finding.ranks)[:MAX_LISTED]
    )


def active_condition(status: dict[str, Any]) -> str | None:
    """``Hung`` or ``Degraded`` when the job carries an active diagnosis, else None."""
    diagnosis = DiagnosisStatus.from_status(status)
    return diagnosis.active_condition if diagnosis else None


def suspect_annotations(finding: Finding) -> dict[str, str | None]:
    """The annotations that name the suspect nodes and ranks (all of them, cut at MAX_LISTED, +N)."""
    return {
        SUSPECT_NODES_ANNOTATION: listed(sorted(finding.nodes)),
        SUSPECT_RANKS_ANNOTATION: listed(sorted(finding.ranks)),
    }


def event_message(
    summary: str,
    confidence: float,
    namespace: str,
    job_name: str,
    cause: str = "",
    node_alerts: list[str] = (),
    report: str | None = None,
) -> str:
    """The Event's text: what, why (``cause host: <figures>``), the named nodes' firing alerts, how
    sure, where the full report is (``report``: its ConfigMap, by default the TrainingJob's)."""
    alerts = f"; firing on its node: {'; '.join(node_alerts)}" if node_alerts else ""
    report = report or report_configmap_name(job_name)
    return (
        f"{summary}{'; ' + cause if cause else ''}{alerts} (confidence {confidence:.2f}; full report: "
        f"kubectl get configmap -n {namespace} {report} -o jsonpath='{{.data.report\\.txt}}')"
    )


def report_configmap(
    job: dict[str, Any], diagnosis: Diagnosis, name: str | None = None, owner: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The report ConfigMap, cut to REPORT_MAX_BYTES (findings' evidence first, then the text); ``name``
    and ``owner`` (reference) for a group of another kind, else the TrainingJob's."""
    document = diagnosis.examination.to_json()
    report_json = json.dumps(document, indent=1, default=str)
    if len(report_json) > REPORT_MAX_BYTES // 2:
        document["findings"] = [
            {**finding, "evidence": "(cut: report over the size limit)"} for finding in document.get("findings", [])
        ][:MAX_LISTED]
        document["truncated"] = True
        report_json = json.dumps(document, default=str)[: REPORT_MAX_BYTES // 2]
    text = diagnosis.examination.text
    if len(text) > REPORT_MAX_BYTES // 2:
        text = text[: REPORT_MAX_BYTES // 2] + "\n(cut: report over the size limit)\n"
    metadata = job["metadata"]
    labels = {api.MANAGED_BY_LABEL: api.MANAGED_BY}
    if owner is None:
        labels[api.JOB_NAME_LABEL] = metadata["name"]
        owner = {
            "apiVersion": api.API_VERSION,
            "kind": api.KIND,
            "name": metadata["name"],
            "uid": metadata["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name or report_configmap_name(metadata["name"]),
            "namespace": metadata["namespace"],
            "labels": labels,
            "ownerReferences": [owner],
        },
        "data": {
            "report.json": report_json,
            "report.txt": text,
            "finding.json": json.dumps({"time": diagnosis.time, "finding": diagnosis.finding.to_json()}, default=str),
        },
    }


def store_report(
    kube: kubernetes.client.ApiClient,
    job: dict[str, Any],
    diagnosis: Diagnosis,
    name: str | None = None,
    owner: dict[str, Any] | None = None,
) -> str:
    """Create or replace the report ConfigMap (``report_configmap``); returns its name."""
    core = kubernetes.client.CoreV1Api(kube)
    manifest = report_configmap(job, diagnosis, name, owner)
    name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
    try:
        core.create_namespaced_config_map(namespace, manifest)
    except ApiException as error:
        if error.status != 409:
            raise
        core.patch_namespaced_config_map(name, namespace, manifest)  # the chart grants patch, not update
    return name


def stored_finding(
    kube: kubernetes.client.ApiClient, namespace: str, name: str, time: str, report: str | None = None
) -> Finding | None:
    """The finding of the diagnosis written at ``time``, from the job's report ConfigMap (``report``:
    its name when not the TrainingJob's; None when the ConfigMap is gone or holds another diagnosis)."""
    try:
        configmap = kubernetes.client.CoreV1Api(kube).read_namespaced_config_map(
            report or report_configmap_name(name), namespace
        )
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    try:
        stored = json.loads((configmap.data or {})["finding.json"])
        return Finding.from_json(stored["finding"]) if stored["time"] == time else None
    except (KeyError, TypeError, ValueError) as error:
        log.warning("TrainingJob %s/%s: report ConfigMap has no readable finding (%s)", namespace, name, error)
        return None


def _annotate(kube: kubernetes.client.ApiClient, namespace: str, name: str, annotations: dict[str, str | None]) -> None:
    kubernetes.client.CustomObjectsApi(kube).patch_namespaced_custom_object(
        api.GROUP, api.VERSION, namespace, api.PLURAL, name, {"metadata": {"annotations": annotations}}
    )


def diagnosis_status(diagnosis: Diagnosis, report_name: str) -> DiagnosisStatus:
    """What a job keeps of an active diagnosis (a TrainingJob's ``status.diagnosis``; the annotation
    ``rankwatch.io/diagnosis`` of another kind's owner); its follow-ups pending."""
    finding = diagnosis.finding
    return DiagnosisStatus(
        active=True,
        reason=finding.reason,
        ranks=tuple(sorted(finding.ranks)[:MAX_LISTED]),
        nodes=tuple(sorted(finding.nodes)[:MAX_LISTED]),
        pods=tuple(diagnosis.pods[:MAX_LISTED]),
        confidence=round(float(finding.confidence), 2),
        summary=finding.summary,
        cause=finding.cause,
        cause_evidence=finding.cause_evidence,
        node_alerts=tuple(node_alert_lines(finding.evidence)[:MAX_LISTED]),
        problems=tuple(diagnosis.examination.report.problems[:MAX_LISTED]),
        communicator=finding.communicator,
        time=diagnosis.time,
        suspicion=diagnosis.examination.suspicion.summary,
        report=report_name,
    )


def write_diagnosis(
    kube: kubernetes.client.ApiClient, namespace: str, name: str, diagnosis: Diagnosis, now: str
) -> dict[str, Any] | None:
    """Put ``diagnosis`` on the job (report, status, annotations, Event); returns the job as
    written, None when the job already carried it (or is gone). Its follow-ups are left pending."""
    objects = kubernetes.client.CustomObjectsApi(kube)
    try:
        job = objects.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    if same_diagnosis(DiagnosisStatus.from_status(job.get("status")), diagnosis):
        return None
    report_name = store_report(kube, job, diagnosis)
    record = diagnosis_status(diagnosis, report_name)
    finding = diagnosis.finding

    def change(job: dict[str, Any]) -> dict[str, Any] | None:
        status = job.get("status") or {}
        if same_diagnosis(DiagnosisStatus.from_status(status), diagnosis):
            return None
        generation = job["metadata"].get("generation", 1)
        conditions = list(status.get("conditions") or [])
        superseded = active_condition(status)
        if superseded and superseded != finding.condition:  # one active finding at a time
            conditions = job_status.set_condition(
                conditions, superseded, "False", "Superseded", f"superseded by {finding.reason}", now, generation
            )
        conditions = job_status.set_condition(
            conditions, finding.condition, "True", finding.reason, finding.summary, now, generation
        )
        return {
            "health": finding.condition,
            "suspects": listed(sorted(finding.nodes)),
            "conditions": conditions,
            **record.to_status(),
        }

    written = update_status(namespace, name, kube=kube, change=change)
    if written is None:
        return None
    job, fields = written
    _annotate(kube, namespace, name, suspect_annotations(finding))
    post_diagnosis_event(kube, job, record)
    return {**job, "status": {**(job.get("status") or {}), **fields}}


def post_diagnosis_event(
    kube: kubernetes.client.ApiClient,
    job: dict[str, Any],
    diagnosis: DiagnosisStatus,
    target: events.EventTarget | None = None,
) -> None:
    """The Warning Event of the diagnosis in ``status.diagnosis``, named after it: a second post (a new
    leader finishing the follow-ups) finds the first and adds nothing. A refusal (4xx) is logged; an
    API server that is away (no answer, a timeout, 5xx, 429) raises, so the follow-ups stay pending and
    whoever finishes them posts the Event first: it is not lost to a control-plane restart."""
    metadata = job["metadata"]
    target = target or events.EventTarget.job(metadata["namespace"], metadata["name"], metadata["uid"])
    cause = f"cause {diagnosis.cause.value}: {diagnosis.cause_evidence}" if diagnosis.cause is not None else ""
    message = event_message(diagnosis.summary, diagnosis.confidence, metadata["namespace"], metadata["name"], cause,
                            list(diagnosis.node_alerts), diagnosis.report or None)  # fmt: skip
    try:
        events.post_event(
            kube,
            target,
            type="Warning",
            reason=diagnosis.reason,
            message=message,
            key=f"diagnosis/{diagnosis.reason}/{diagnosis.time}",
            repeat=False,
            now=datetime.datetime.now(datetime.UTC),
        )
    except ApiException as error:
        if error.status is None or error.status >= 500 or error.status == 429:
            raise
        log.warning("Event %s on %s %s/%s not posted: HTTP %s", diagnosis.reason, target.kind, metadata["namespace"],
                    metadata["name"], error.status)  # fmt: skip


def pending_follow_ups(status: dict[str, Any], alerting: bool) -> list[FollowUp]:
    """What the active diagnosis in ``status`` still calls for (``remediation``, ``alertedTime``)."""
    diagnosis = DiagnosisStatus.from_status(status)
    return diagnosis.pending(alerting) if diagnosis else []


def record_follow_up(
    kube: kubernetes.client.ApiClient, namespace: str, name: str, time: str, field: FollowUp, value: str
) -> bool:
    """Mark one follow-up of the diagnosis written at ``time`` done; False when the job carries
    another diagnosis by now (or is gone)."""

    def change(job: dict[str, Any]) -> dict[str, Any] | None:
        diagnosis = DiagnosisStatus.from_status(job.get("status"))
        if diagnosis is None or diagnosis.time != time or diagnosis.follow_up_done(field):
            return None
        return diagnosis.with_follow_up(field, value).to_status()

    return update_status(namespace, name, kube=kube, change=change) is not None


def write_recovered(kube: kubernetes.client.ApiClient, namespace: str, name: str, why: str, now: str) -> dict | None:
    """Clear the active diagnosis: condition False (reason Recovered), health Healthy, suspects and
    annotations removed, a Normal Event. The diagnosis stays in the status, inactive, with
    ``resolvedTime``, so the last finding is still readable."""

    def change(job: dict[str, Any]) -> dict[str, Any] | None:
        status = job.get("status") or {}
        condition = active_condition(status)
        if condition is None:
            return None
        generation = job["metadata"].get("generation", 1)
        message = f"recovered: {why}"
        conditions = job_status.set_condition(
            list(status.get("conditions") or []), condition, "False", "Recovered", message, now, generation
        )
        diagnosis = DiagnosisStatus.from_status(status).resolved(now)
        return {"health": "Healthy", "suspects": "", "conditions": conditions, **diagnosis.to_status()}

    written = update_status(namespace, name, kube=kube, change=change)
    if written is None:
        return None
    job, _ = written
    _annotate(kube, namespace, name, {SUSPECT_NODES_ANNOTATION: None, SUSPECT_RANKS_ANNOTATION: None})
    previous = DiagnosisStatus.from_status(job.get("status"))
    metadata = job["metadata"]
    try:
        events.post_event(
            kube,
            events.EventTarget.job(namespace, name, metadata["uid"]),
            type="Normal",
            reason=event_reasons.RECOVERED,
            message=recovered_message(previous, why),
            key=recovered_key(previous),
            repeat=False,
            now=datetime.datetime.now(datetime.UTC),
        )
    except ApiException as error:
        log.warning("Event Recovered on TrainingJob %s/%s not posted: HTTP %s", namespace, name, error.status)
    return job


def recovered_message(previous: DiagnosisStatus | None, why: str) -> str:
    """The ``Recovered`` Event's text: what was cleared, why, and what it said."""
    kind = previous.reason if previous else "finding"
    return f"{kind} cleared: {why} (was: {previous.summary if previous else ''})"


def recovered_key(previous: DiagnosisStatus | None) -> str:
    """Names the ``Recovered`` Event after the diagnosis it clears (a second post finds the first)."""
    return f"recovered/{previous.reason if previous else None}/{previous.time if previous else None}"


def write_telemetry_flowing(kube: kubernetes.client.ApiClient, namespace: str, name: str, now: str,
                            step_time: str | None) -> bool:  # fmt: skip
    """Hung and Degraded leave Unknown/AwaitingTelemetry for False once summaries arrive; True if written."""

    def change(job: dict[str, Any]) -> dict[str, Any] | None:
        status = job.get("status") or {}
        conditions = list(status.get("conditions") or [])
        waiting = [
            c for c in conditions if c.get("type") in (HUNG, DEGRADED) and c.get("reason") == "AwaitingTelemetry"
        ]
        if not waiting or status.get("phase") in job_status.TERMINAL:
            return None
        generation = job["metadata"].get("generation", 1)
        for condition in waiting:
            conditions = job_status.set_condition(
                conditions,
                condition["type"],
                "False",
                "TelemetryHealthy",
                "window summaries arrive from the sidecars; nothing out of line",
                now,
                generation,
            )
        fields: dict[str, Any] = {"conditions": conditions}
        if status.get("health") in (None, "Unknown"):
            fields["health"] = "Healthy"
        if step_time:
            fields["stepTime"] = step_time
        return fields

    return update_status(namespace, name, kube=kube, change=change) is not None


def write_step_time(kube: kubernetes.client.ApiClient, namespace: str, name: str, step_time: str) -> None:
    """The printer column ``Step time``; written only when it changed (the caller decides how much)."""

    def change(job: dict[str, Any]) -> dict[str, Any] | None:
        return None if job.get("status", {}).get("stepTime") == step_time else {"stepTime": step_time}

    update_status(namespace, name, kube=kube, change=change)
