"""A PyTorchJob's restart lever: its ``spec.runPolicy.suspend`` toggle, as an Indexed Job's (``restart_suspend.py``).
Suspended, the training-operator deletes every pod and Service of the job before it looks at any pod's
failure (so the ended attempt fails nothing); resumed, it makes every replica's pod again, scheduled anew,
so away from the cordoned suspects. Its other ways are not safe: it restarts one replica's pod in place
(``restartPolicy``, ``ExitCode``) while its peers wait in the old rendezvous, and deleting the pods can
fail the job (a pod that ends ``Failed`` under ``Never`` or a non-retryable exit code).

Two steps, level-triggered so that an operator that dies between them never leaves a job suspended:
``pull`` suspends the PyTorchJob and marks it (``rankwatch.io/restart-suspended``) in one conditional
patch; ``pytorchjob_suspended_for_restart`` (a kopf handler on PyTorchJobs carrying the mark, so also at a
new leader's start; registered only with the webhook on) resumes it once none of its pods is left, and
removes the mark.

Refused (cordon and page only) when someone else owns ``runPolicy.suspend``: Kueue, when it admits the job
(label ``kueue.x-k8s.io/queue-name``), a controller that owns the job, or a job suspended already; a
finished job (Succeeded or Failed: the training-operator does not restart it); past
``rankwatch.io/max-restarts`` (``rankwatch.io/restarts``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf
import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch.model.diagnosis_status import DiagnosisStatus
from rankwatch.operator.kinds.adapter import Group
from rankwatch.operator.kinds.lever import LeverRefused, Pulled
from rankwatch.operator.kinds.pytorchjob import API_VERSION, JOB_NAME_LABEL
from rankwatch.operator.kinds.restart_suspend import KUEUE_QUEUE, RESTARTS_ANNOTATION, SUSPENDED_ANNOTATION, restarts_of
from rankwatch.operator.spec import TrainingJobSpec

log = logging.getLogger(__name__)

API_GROUP, _, VERSION = API_VERSION.rpartition("/")
PLURAL = "pytorchjobs"
RESUME_HANDLER_ID = "rankwatch-resume-suspended-pytorchjob"
DRAIN_POLL_S = 1.0
DRAIN_PATIENCE_S = 600.0
"""How long one look waits for the pods to go; a later event of the job (or a new leader) looks again."""
_watching = False


def finished(owner: Mapping[str, Any]) -> str | None:
    """``Succeeded`` or ``Failed`` when the training-operator ended the job, else None."""
    for condition in (owner.get("status") or {}).get("conditions") or []:
        if condition.get("type") in ("Succeeded", "Failed") and condition.get("status") == "True":
            return str(condition["type"])
    return None


class PyTorchJobSuspend:
    def refusal(
        self, kube: kubernetes.client.ApiClient, owner: Mapping[str, Any], diagnosis: DiagnosisStatus,
        pods: list[dict[str, Any]], spec: TrainingJobSpec,
    ) -> str | None:  # fmt: skip
        metadata = owner.get("metadata") or {}
        run_policy = (owner.get("spec") or {}).get("runPolicy") or {}
        if KUEUE_QUEUE in (metadata.get("labels") or {}) or KUEUE_QUEUE in (metadata.get("annotations") or {}):
            return f"Kueue admits this PyTorchJob ({KUEUE_QUEUE}): its runPolicy.suspend is Kueue's"
        controller = next((o for o in metadata.get("ownerReferences") or [] if o.get("controller")), None)
        if controller is not None:
            owner = f"{controller.get('kind')} {controller.get('name')}"
            return f"the PyTorchJob is controlled by {owner}, which owns its spec"
        if run_policy.get("suspend"):
            return "the PyTorchJob is suspended already"
        ended = finished(owner)
        if ended:
            return f"the PyTorchJob has {ended}: the training-operator makes no new pods for it"
        used = restarts_of(owner)
        if used >= spec.recovery.maxRestarts:
            return f"{used} restart(s) of at most {spec.recovery.maxRestarts} used ({RESTARTS_ANNOTATION})"
        return None

    def pull(
        self, kube: kubernetes.client.ApiClient, group: Group, owner: Mapping[str, Any],
        diagnosis: DiagnosisStatus, pods: list[dict[str, Any]], spec: TrainingJobSpec,
    ) -> Pulled:  # fmt: skip
        restarts = restarts_of(owner) + 1
        patch = {
            "metadata": {
                "resourceVersion": owner["metadata"]["resourceVersion"],
                "annotations": {SUSPENDED_ANNOTATION: diagnosis.time, RESTARTS_ANNOTATION: str(restarts)},
            },
            "spec": {"runPolicy": {"suspend": True}},
        }
        try:
            kubernetes.client.CustomObjectsApi(kube).patch_namespaced_custom_object(
                API_GROUP, VERSION, group.namespace, PLURAL, group.name, patch
            )
        except ApiException as error:
            if error.status == 409:
                raise LeverRefused("the PyTorchJob changed while rankwatch suspended it") from None
            raise
        done = (
            f"suspended the PyTorchJob to end every pod, resumed once they are gone (restart {restarts} of at "
            f"most {spec.recovery.maxRestarts})"
        )
        return Pulled(done, frozenset())  # its pods come back under the same names


PYTORCHJOB_LEVER = PyTorchJobSuspend()


def _pods_left(kube: kubernetes.client.ApiClient, job: Mapping[str, Any]) -> bool:
    metadata = job["metadata"]
    pods = kubernetes.client.CoreV1Api(kube).list_namespaced_pod(
        metadata["namespace"], label_selector=f"{JOB_NAME_LABEL}={metadata['name']}"
    )
    return any(
        any(o.controller and o.uid == metadata["uid"] for o in pod.metadata.owner_references or [])
        for pod in pods.items
    )


def resume_when_drained(kube: kubernetes.client.ApiClient, job: Mapping[str, Any]) -> bool | None:
    """Resume a PyTorchJob rankwatch suspended once none of its pods is left (and drop the mark): True when
    resumed now, None when pods are left, False when it is gone or changed (its next event looks again).
    Blocking."""
    metadata = job.get("metadata") or {}
    if ((job.get("spec") or {}).get("runPolicy") or {}).get("suspend") and _pods_left(kube, job):
        return None
    patch: dict[str, Any] = {
        "metadata": {"resourceVersion": metadata["resourceVersion"], "annotations": {SUSPENDED_ANNOTATION: None}},
        "spec": {"runPolicy": {"suspend": False}},
    }
    try:
        kubernetes.client.CustomObjectsApi(kube).patch_namespaced_custom_object(
            API_GROUP, VERSION, metadata["namespace"], PLURAL, metadata["name"], patch
        )
    except ApiException as error:
        if error.status in (404, 409):
            return False
        raise
    log.warning("PyTorchJob %s/%s: its pods are gone; resumed (restart away from the suspects)",
                metadata["namespace"], metadata["name"])  # fmt: skip
    return True


async def pytorchjob_suspended_for_restart(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
    """Resume the job once its pods are gone: the training-operator may write nothing on the job when the
    last pod goes, so this look waits for it (bounded; the job's next event or a new leader looks again)."""
    deadline = time.monotonic() + DRAIN_PATIENCE_S
    while type != "DELETED" and "kube" in memo and memo.leading() and time.monotonic() < deadline:
        outcome = await asyncio.to_thread(resume_when_drained, memo.kube, dict(body))
        if outcome is not None:
            return
        await asyncio.sleep(DRAIN_POLL_S)


def watch_suspended_pytorchjobs() -> None:
    """Register ``pytorchjob_suspended_for_restart`` (from the operator's startup, before kopf starts
    watching): only with the admission webhook on, the only case the chart grants a watch on PyTorchJobs.
    Where no PyTorchJob CRD is installed, kopf serves it once one is."""
    global _watching
    if _watching:
        return  # a second start in one process: kopf's registry keeps the first
    kopf.on.event(API_GROUP, VERSION, PLURAL, id=RESUME_HANDLER_ID,
                  annotations={SUSPENDED_ANNOTATION: kopf.PRESENT})(pytorchjob_suspended_for_restart)  # fmt: skip
    _watching = True
