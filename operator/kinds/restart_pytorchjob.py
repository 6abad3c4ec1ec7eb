"""A PyTorchJob's restart lever: its ``spec.runPolicy.suspend`` toggle, as an Indexed Job's.
Suspended, the training-operator deletes every pod and Service of the job before it looks at any pod's
failure (so the ended attempt fails nothing); resumed, it makes every replica's pod again, scheduled anew,
so away from the cordoned suspects. Its other ways are not safe: it restarts one replica's pod in place
(``restartPolicy``, ``ExitCode``) while its peers wait in the old rendezvous, and deleting the pods can
fail the job (a pod that ends ``Failed`` under ``Never`` or a non-retryable exit code).

The two steps (suspend and mark; resume once no pod is left) are ``suspend_toggle.py``'s.

Refused (cordon and page only) when someone else owns ``runPolicy.suspend``: Kueue, when it admits the job
(label ``kueue.x-k8s.io/queue-name``), a controller that owns the job, or a job suspended already; a
finished job (Succeeded or Failed: the training-operator does not restart it); past
``rankwatch.io/max-restarts`` (``rankwatch.io/restarts``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kubernetes

from rankwatch.model.diagnosis_status import DiagnosisStatus
from rankwatch.operator.kinds.adapter import Group
from rankwatch.operator.kinds.lever import Pulled
from rankwatch.operator.kinds.pytorchjob import API_VERSION, JOB_NAME_LABEL
from rankwatch.operator.kinds.suspend_toggle import CustomObjects, SuspendToggle
from rankwatch.operator.spec import TrainingJobSpec


def finished(owner: Mapping[str, Any]) -> str | None:
    """``Succeeded`` or ``Failed`` when the training-operator ended the job, else None."""
    for condition in (owner.get("status") or {}).get("conditions") or []:
        if condition.get("type") in ("Succeeded", "Failed") and condition.get("status") == "True":
            return str(condition["type"])
    return None


def _drained(kube: kubernetes.client.ApiClient, job: Mapping[str, Any]) -> bool:
    metadata = job["metadata"]
    pods = kubernetes.client.CoreV1Api(kube).list_namespaced_pod(
        metadata["namespace"], label_selector=f"{JOB_NAME_LABEL}={metadata['name']}"
    )
    return not any(
        any(o.controller and o.uid == metadata["uid"] for o in pod.metadata.owner_references or [])
        for pod in pods.items
    )


TOGGLE = SuspendToggle("PyTorchJob", CustomObjects(API_VERSION, "pytorchjobs"), ("runPolicy", "suspend"), _drained,
                       "rankwatch-resume-suspended-pytorchjob")  # fmt: skip


class PyTorchJobSuspend:
    def refusal(
        self, kube: kubernetes.client.ApiClient, owner: Mapping[str, Any], diagnosis: DiagnosisStatus,
        pods: list[dict[str, Any]], spec: TrainingJobSpec,
    ) -> str | None:  # fmt: skip
        other = TOGGLE.owner_of_suspend(owner)
        if other is not None:
            return other
        if TOGGLE.suspended(owner):
            return TOGGLE.refusal_of_state(owner, spec)
        ended = finished(owner)
        if ended:
            return f"the PyTorchJob has {ended}: the training-operator makes no new pods for it"
        return TOGGLE.refusal_of_state(owner, spec)

    def pull(
        self, kube: kubernetes.client.ApiClient, group: Group, owner: Mapping[str, Any],
        diagnosis: DiagnosisStatus, pods: list[dict[str, Any]], spec: TrainingJobSpec,
    ) -> Pulled:  # fmt: skip
        done = TOGGLE.suspend(kube, group, owner, diagnosis, spec)
        return Pulled(done, frozenset())  # its pods come back under the same names


PYTORCHJOB_LEVER = PyTorchJobSuspend()
watch_suspended_pytorchjobs = TOGGLE.watch
