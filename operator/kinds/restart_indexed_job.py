"""An Indexed Job's restart lever: the ``spec.suspend`` toggle. Suspending a Job makes its controller
delete every running pod (not counted against ``backoffLimit``); resuming it makes a new pod for each
index, scheduled anew, so away from the cordoned suspects.

The two steps (suspend and mark; resume once no pod is left) are ``suspend_toggle.py``'s.

Refused (cordon and page only) when someone else owns ``spec.suspend``: Kueue, when it admits the Job
(label ``kueue.x-k8s.io/queue-name``), a controller that owns the Job, another ``managedBy``, or a Job
already suspended; and past ``rankwatch.io/max-restarts`` restarts (counted in ``rankwatch.io/restarts``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kubernetes

from rankwatch.model.diagnosis_status import DiagnosisStatus
from rankwatch.operator.kinds.adapter import Group
from rankwatch.operator.kinds.indexed_job import CONTROLLER_UID_LABEL
from rankwatch.operator.kinds.lever import Pulled
from rankwatch.operator.kinds.suspend_toggle import BatchJobs, SuspendToggle
from rankwatch.operator.spec import TrainingJobSpec

JOB_CONTROLLER = "kubernetes.io/job-controller"


def _drained(kube: kubernetes.client.ApiClient, job: Mapping[str, Any]) -> bool:
    metadata, status = job["metadata"], job.get("status") or {}
    if status.get("active") or status.get("terminating"):
        return False
    pods = kubernetes.client.CoreV1Api(kube).list_namespaced_pod(
        metadata["namespace"], label_selector=f"{CONTROLLER_UID_LABEL}={metadata['uid']}"
    )
    return not pods.items


TOGGLE = SuspendToggle("Job", BatchJobs(), ("suspend",), _drained, "rankwatch-resume-suspended-job")


class IndexedJobSuspend:
    def refusal(
        self, kube: kubernetes.client.ApiClient, owner: Mapping[str, Any], diagnosis: DiagnosisStatus,
        pods: list[dict[str, Any]], spec: TrainingJobSpec,
    ) -> str | None:  # fmt: skip
        other = TOGGLE.owner_of_suspend(owner)
        if other is not None:
            return other
        managed_by = (owner.get("spec") or {}).get("managedBy")
        if managed_by not in (None, JOB_CONTROLLER):
            return f"the Job is managed by {managed_by}"
        return TOGGLE.refusal_of_state(owner, spec)

    def pull(
        self, kube: kubernetes.client.ApiClient, group: Group, owner: Mapping[str, Any],
        diagnosis: DiagnosisStatus, pods: list[dict[str, Any]], spec: TrainingJobSpec,
    ) -> Pulled:  # fmt: skip
        done = TOGGLE.suspend(kube, group, owner, diagnosis, spec)
        return Pulled(done, frozenset(pod["metadata"]["name"] for pod in pods))


INDEXED_JOB_LEVER = IndexedJobSuspend()
watch_suspended_jobs = TOGGLE.watch
