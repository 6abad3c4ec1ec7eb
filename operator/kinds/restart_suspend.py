"""An Indexed Job's restart lever: the ``spec.suspend`` toggle. Suspending a Job makes its controller
delete every running pod (not counted against ``backoffLimit``); resuming it makes a new pod for each
index, scheduled anew, so away from the cordoned suspects.

Two steps, each level-triggered so that an operator that dies between them never leaves a training job
suspended: ``pull`` suspends the Job and marks it (``rankwatch.io/restart-suspended``: the diagnosis
it restarts for) in one conditional patch; ``resume_when_drained`` (a kopf handler on Jobs carrying the
mark, so also at a new leader's start; registered only with the webhook on, see ``watch_suspended_jobs``)
resumes it once none of its pods is left, and removes the mark.

Refused (cordon and page only) when someone else owns ``spec.suspend``: Kueue, when it admits the Job
(label ``kueue.x-k8s.io/queue-name``), a controller that owns the Job, or a Job already suspended; and
past ``rankwatch.io/max-restarts`` restarts (counted in the Job's ``rankwatch.io/restarts``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import kopf
import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch.model.diagnosis_status import DiagnosisStatus
from rankwatch.operator.kinds.adapter import Group
from rankwatch.operator.kinds.indexed_job import CONTROLLER_UID_LABEL
from rankwatch.operator.kinds.lever import LeverRefused, Pulled
from rankwatch.operator.spec import TrainingJobSpec

log = logging.getLogger(__name__)

SUSPENDED_ANNOTATION = "rankwatch.io/restart-suspended"
"""On a Job rankwatch suspended to restart it: the diagnosis's time; removed when it is resumed."""
RESTARTS_ANNOTATION = "rankwatch.io/restarts"
"""On a Job: how many times rankwatch restarted it."""
RESUME_HANDLER_ID = "rankwatch-resume-suspended-job"
_watching = False
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
JOB_CONTROLLER = "kubernetes.io/job-controller"


def restarts_of(job: Mapping[str, Any]) -> int:
    value = ((job.get("metadata") or {}).get("annotations") or {}).get(RESTARTS_ANNOTATION, "0")
    return int(value) if value.isdigit() else 0


class SuspendToggle:
    def refusal(
        self, kube: kubernetes.client.ApiClient, owner: Mapping[str, Any], diagnosis: DiagnosisStatus,
        pods: list[dict[str, Any]], spec: TrainingJobSpec,
    ) -> str | None:  # fmt: skip
        metadata, job_spec = owner.get("metadata") or {}, owner.get("spec") or {}
        if KUEUE_QUEUE in (metadata.get("labels") or {}) or KUEUE_QUEUE in (metadata.get("annotations") or {}):
            return f"Kueue admits this Job ({KUEUE_QUEUE}): its spec.suspend is Kueue's"
        controller = next((o for o in metadata.get("ownerReferences") or [] if o.get("controller")), None)
        if controller is not None:
            return f"the Job is controlled by {controller.get('kind')} {controller.get('name')}, which owns its spec"
        if job_spec.get("managedBy") not in (None, JOB_CONTROLLER):
            return f"the Job is managed by {job_spec.get('managedBy')}"
        if job_spec.get("suspend"):
            return "the Job is suspended already"
        used = restarts_of(owner)
        if used >= spec.recovery.maxRestarts:
            return f"{used} restart(s) of at most {spec.recovery.maxRestarts} used ({RESTARTS_ANNOTATION})"
        return None

    def pull(
        self, kube: kubernetes.client.ApiClient, group: Group, owner: Mapping[str, Any],
        diagnosis: DiagnosisStatus, pods: list[dict[str, Any]], spec: TrainingJobSpec,
    ) -> Pulled:  # fmt: skip
        metadata = owner["metadata"]
        restarts = restarts_of(owner) + 1
        patch = {
            "metadata": {
                "resourceVersion": metadata["resourceVersion"],
                "annotations": {SUSPENDED_ANNOTATION: diagnosis.time, RESTARTS_ANNOTATION: str(restarts)},
            },
            "spec": {"suspend": True},
        }
        try:
            kubernetes.client.BatchV1Api(kube).patch_namespaced_job(group.name, group.namespace, patch)
        except ApiException as error:
            if error.status == 409:
                raise LeverRefused("the Job changed while rankwatch suspended it") from None
            raise
        done = (
            f"suspended the Job to end every pod, resumed once they are gone (restart {restarts} of at most "
            f"{spec.recovery.maxRestarts})"
        )
        return Pulled(done, frozenset(pod["metadata"]["name"] for pod in pods))


SUSPEND_LEVER = SuspendToggle()


def resume_when_drained(kube: kubernetes.client.ApiClient, job: Mapping[str, Any]) -> bool:
    """Resume a Job rankwatch suspended once none of its pods is left (and drop the mark); True when it
    was resumed now. Blocking."""
    metadata, status = job.get("metadata") or {}, job.get("status") or {}
    namespace, name = metadata["namespace"], metadata["name"]
    if (job.get("spec") or {}).get("suspend"):
        if status.get("active") or status.get("terminating"):
            return False
        pods = kubernetes.client.CoreV1Api(kube).list_namespaced_pod(
            namespace, label_selector=f"{CONTROLLER_UID_LABEL}={metadata['uid']}"
        )
        if pods.items:
            return False
    patch: dict[str, Any] = {
        "metadata": {"resourceVersion": metadata["resourceVersion"], "annotations": {SUSPENDED_ANNOTATION: None}},
        "spec": {"suspend": False},
    }
    try:
        kubernetes.client.BatchV1Api(kube).patch_namespaced_job(name, namespace, patch)
    except ApiException as error:
        if error.status in (404, 409):
            return False  # gone, or changed: its next event looks again
        raise
    log.warning("Job %s/%s: its pods are gone; resumed (restart away from the suspects)", namespace, name)
    return True


async def job_suspended_for_restart(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
    if type == "DELETED" or "kube" not in memo or not memo.leading():
        return  # gone; or not leading (the leader resumes it)
    await asyncio.to_thread(resume_when_drained, memo.kube, dict(body))


def watch_suspended_jobs() -> None:
    """Register ``job_suspended_for_restart`` (from the operator's startup, before kopf starts watching):
    only with the admission webhook on, the only case the chart grants a watch on Jobs (and the only
    one with groups of other kinds to restart)."""
    global _watching
    if _watching:
        return  # a second start in one process: kopf's registry keeps the first
    kopf.on.event("batch", "v1", "jobs", id=RESUME_HANDLER_ID,
                  annotations={SUSPENDED_ANNOTATION: kopf.PRESENT})(job_suspended_for_restart)  # fmt: skip
    _watching = True
