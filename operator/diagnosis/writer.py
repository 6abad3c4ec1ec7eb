"""Write a diagnosis onto the TrainingJob, and clear it when the job recovers.

What a person sees: ``status.diagnosis``, the ``Hung`` / ``Degraded`` condition with reason and
message, ``status.health`` and ``status.suspects`` (printer columns), the annotations
``rankwatch.io/suspect-nodes`` / ``suspect-ranks``, a Warning Event whose message names rank, node and
the numbers, and the full report (JSON + text) in a ConfigMap the job owns.

"Already reported" is read from the job's status, not from memory, so a restarted operator that
diagnoses the same culprit again writes nothing and posts no second Event. Blocking (the
Kubernetes client): call these in a worker thread. Status patches carry the resourceVersion they
were computed from, so a concurrent writer (the pod-status sync) means recompute, never overwrite.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch.operator import api
from rankwatch.operator.diagnosis.diagnose import Diagnosis
from rankwatch.operator.lifecycle import job_events, job_status
from rankwatch.operator.lifecycle.status_patch import update_status

log = logging.getLogger(__name__)

SUSPECT_NODES_ANNOTATION = "rankwatch.io/suspect-nodes"
SUSPECT_RANKS_ANNOTATION = "rankwatch.io/suspect-ranks"
REPORT_MAX_BYTES = 512 << 10
"""The report ConfigMap stays well under the 1 MiB object limit; longer reports are cut, saying so."""
MAX_LISTED = 32


def report_configmap_name(job_name: str) -> str:
    return f"{job_name}-rankwatch-report"


def _listed(values: list[Any]) -> str:
    text = ",".join(map(str, values[:MAX_LISTED]))
    return text + (f",+{len(values) - MAX_LISTED}" if len(values) > MAX_LISTED else "")


def same_diagnosis(previous: dict[str, Any] | None, diagnosis: Diagnosis) -> bool:
    """The job already carries this finding (active, same condition, same culprit ranks)."""
    if not previous or not previous.get("active"):
        return False
    previous_hung = previous.get("kind") in ("Hang", "StuckInCollective")
    return previous_hung == diagnosis.hung and sorted(previous.get("ranks") or []) == diagnosis.ranks


def active_condition(status: dict[str, Any]) -> str | None:
    """``Hung`` or ``Degraded`` when the job carries an active diagnosis, else None."""
    diagnosis = status.get("diagnosis") or {}
    if not diagnosis.get("active"):
        return None
    return "Hung" if diagnosis.get("kind") in ("Hang", "StuckInCollective") else "Degraded"


def event_message(diagnosis: Diagnosis, job_name: str) -> str:
    return (
        f"{diagnosis.summary} (confidence {diagnosis.confidence:.2f}; full report: "
        f"kubectl get configmap {report_configmap_name(job_name)} -o jsonpath='{{.data.report\\.txt}}')"
    )


def report_configmap(job: dict[str, Any], diagnosis: Diagnosis) -> dict[str, Any]:
    """The report ConfigMap, cut to REPORT_MAX_BYTES (findings' evidence first, then the text)."""
    document = dict(diagnosis.report)
    report_json = json.dumps(document, indent=1, default=str)
    if len(report_json) > REPORT_MAX_BYTES // 2:
        document["findings"] = [
            {**finding, "evidence": "(cut: report over the size limit)"} for finding in document.get("findings", [])
        ][:MAX_LISTED]
        document["truncated"] = True
        report_json = json.dumps(document, default=str)[: REPORT_MAX_BYTES // 2]
    text = diagnosis.text
    if len(text) > REPORT_MAX_BYTES // 2:
        text = text[: REPORT_MAX_BYTES // 2] + "\n(cut: report over the size limit)\n"
    metadata = job["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": report_configmap_name(metadata["name"]),
            "namespace": metadata["namespace"],
            "labels": {api.JOB_NAME_LABEL: metadata["name"], api.MANAGED_BY_LABEL: api.MANAGED_BY},
            "ownerReferences": [
                {
                    "apiVersion": api.API_VERSION,
                    "kind": api.KIND,
                    "name": metadata["name"],
                    "uid": metadata["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "data": {"report.json": report_json, "report.txt": text},
    }


def _store_report(job: dict[str, Any], diagnosis: Diagnosis) -> str:
    core = kubernetes.client.CoreV1Api()
    manifest = report_configmap(job, diagnosis)
    name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
    try:
        core.create_namespaced_config_map(namespace, manifest)
    except ApiException as error:
        if error.status != 409:
            raise
        core.replace_namespaced_config_map(name, namespace, manifest)
    return name


def _annotate(namespace: str, name: str, annotations: dict[str, str | None]) -> None:
    kubernetes.client.CustomObjectsApi().patch_namespaced_custom_object(
        api.GROUP, api.VERSION, namespace, api.PLURAL, name, {"metadata": {"annotations": annotations}}
    )


def write_diagnosis(namespace: str, name: str, diagnosis: Diagnosis, now: str) -> dict[str, Any] | None:
    """Put ``diagnosis`` on the job; returns the job (as read) when written, None when the job
    already carried it (or is gone)."""
    objects = kubernetes.client.CustomObjectsApi()
    try:
        job = objects.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    if same_diagnosis((job.get("status") or {}).get("diagnosis"), diagnosis):
        return None
    report_name = _store_report(job, diagnosis)

    def change(job: dict[str, Any]) -> dict[str, Any] | None:
        status = job.get("status") or {}
        if same_diagnosis(status.get("diagnosis"), diagnosis):
            return None
        generation = job["metadata"].get("generation", 1)
        reason = diagnosis.kind
        message = diagnosis.summary
        conditions = list(status.get("conditions") or [])
        superseded = active_condition(status)
        if superseded and superseded != diagnosis.condition:  # one active finding at a time
            conditions = job_status.set_condition(
                conditions, superseded, "False", "Superseded", f"superseded by {diagnosis.kind}", now, generation
            )
        conditions = job_status.set_condition(conditions, diagnosis.condition, "True", reason, message, now, generation)
        return {
            "health": diagnosis.condition,
            "suspects": _listed(diagnosis.nodes),
            "conditions": conditions,
            "diagnosis": {
                "active": True,
                "kind": diagnosis.kind,
                "ranks": diagnosis.ranks[:MAX_LISTED],
                "nodes": diagnosis.nodes[:MAX_LISTED],
                "pods": diagnosis.pods[:MAX_LISTED],
                "confidence": diagnosis.confidence,
                "summary": diagnosis.summary,
                "communicator": diagnosis.finding.get("communicator"),
                "time": diagnosis.time,
                "resolvedTime": None,
                "suspicion": diagnosis.suspicion,
                "report": report_name,
            },
        }

    written = update_status(namespace, name, change)
    if written is None:
        return None
    job, _ = written
    _annotate(
        namespace,
        name,
        {SUSPECT_NODES_ANNOTATION: _listed(diagnosis.nodes), SUSPECT_RANKS_ANNOTATION: _listed(diagnosis.ranks)},
    )
    job_events.post(job, "Warning", diagnosis.kind, event_message(diagnosis, name))
    return job


def write_recovered(namespace: str, name: str, why: str, now: str) -> dict[str, Any] | None:
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
        diagnosis = {**status["diagnosis"], "active": False, "resolvedTime": now}
        return {"health": "Healthy", "suspects": "", "conditions": conditions, "diagnosis": diagnosis}

    written = update_status(namespace, name, change)
    if written is None:
        return None
    job, _ = written
    _annotate(namespace, name, {SUSPECT_NODES_ANNOTATION: None, SUSPECT_RANKS_ANNOTATION: None})
    previous = (job.get("status") or {}).get("diagnosis") or {}
    job_events.post(
        job,
        "Normal",
        "Recovered",
        f"{previous.get('kind', 'finding')} cleared: {why} (was: {previous.get('summary', '')})",
    )
    return job


def write_telemetry_flowing(namespace: str, name: str, now: str, step_time: str | None) -> bool:
    """Hung and Degraded leave Unknown/AwaitingTelemetry for False once summaries arrive; True if written."""

    def change(job: dict[str, Any]) -> dict[str, Any] | None:
        status = job.get("status") or {}
        conditions = list(status.get("conditions") or [])
        waiting = [
            c for c in conditions if c.get("type") in ("Hung", "Degraded") and c.get("reason") == "AwaitingTelemetry"
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

    return update_status(namespace, name, change) is not None


def write_step_time(namespace: str, name: str, step_time: str) -> None:
    """The printer column ``Step time``; written only when it changed (the caller decides how much)."""
    update_status(namespace, name, lambda job: None if job.get("status", {}).get("stepTime") == step_time else {
        "stepTime": step_time
    })  # fmt: skip
