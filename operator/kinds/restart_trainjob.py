"""A TrainJob's restart lever: its ``spec.suspend`` toggle, which Kubeflow Trainer v2 hands down to the
whole chain (read in v2.3.0 and JobSet v0.12.0); where Kueue owns that, its JobSet's ``failurePolicy``.

The Trainer copies the TrainJob's ``suspend`` onto its JobSet (``plugins/jobset/jobset.go`` Build; it
rewrites the JobSet only while one of the two is suspended), the JobSet controller suspends every child
Job (``suspendJobs``) and the Job controller deletes their pods, counting no failure. Resumed, the JobSet
controller resumes the same Jobs (``resumeJobsIfNecessary``) and each makes a new pod per index,
scheduled anew, so away from the cordoned suspects. ``spec.suspend`` is mutable on a running TrainJob (its
webhook guards only ``runtimePatches``). It is preferred to the JobSet's own ``failurePolicy`` lever
(``restart_jobset.py``): the Trainer's runtimes give their JobSet none (a failed child Job would fail the
TrainJob), and a suspend spends none of its ``maxRestarts``.

Two steps, as an Indexed Job's (``restart_suspend.py``, whose marks it shares), each level-triggered so
that an operator that dies between them never leaves a training job suspended: ``pull`` suspends the
TrainJob and marks it (``rankwatch.io/restart-suspended``) in one conditional patch; a kopf handler on
TrainJobs carrying the mark (so also at a new leader's start) resumes it once no pod of its JobSet is
left, and removes the mark. The TrainJob's status follows its JobSet's Jobs, not their pods, so its last
change may come while the pods still terminate: the handler looks again every few seconds until they
are gone (a kopf timer or daemon would put a finalizer on the user's TrainJob).

Where someone else owns ``spec.suspend`` (Kueue, when it admits the TrainJob: label
``kueue.x-k8s.io/queue-name``; MultiKueue: ``spec.managedBy``; a controller that owns the TrainJob) the
suspend is never touched: the group is restarted through its JobSet's ``failurePolicy`` when the runtime
gives the JobSet one answering a failed child Job with a whole-group restart within its ``maxRestarts``
(Kueue keeps the workload admitted through it), else cordon and page only. Also refused when the TrainJob
is suspended already, or past ``rankwatch.io/max-restarts`` suspends (counted in ``rankwatch.io/restarts``).
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
from rankwatch.operator.kinds import jobset, trainjob
from rankwatch.operator.kinds.adapter import Group
from rankwatch.operator.kinds.jobset import JOBSET
from rankwatch.operator.kinds.lever import LeverRefused, Pulled
from rankwatch.operator.kinds.restart_jobset import JOBSET_LEVER
from rankwatch.operator.kinds.restart_suspend import KUEUE_QUEUE, RESTARTS_ANNOTATION, SUSPENDED_ANNOTATION, restarts_of
from rankwatch.operator.spec import TrainingJobSpec

log = logging.getLogger(__name__)

TRAINER_MANAGER = "trainer.kubeflow.org/trainjob-controller"
"""``spec.managedBy`` of a TrainJob the Trainer itself reconciles (its default)."""
RESUME_HANDLER_ID = "rankwatch-resume-suspended-trainjob"
LOOK_AGAIN_S = 2.0
DRAIN_PATIENCE_S = 900.0
"""How long one event's handler waits for the pods to go; the TrainJob's next event (or a new leader)
looks again."""
_API_GROUP, _, _VERSION = trainjob.API_VERSION.rpartition("/")
_watching = False


def suspend_owner(trainjob_: Mapping[str, Any]) -> str | None:
    """Who other than the Trainer owns the TrainJob's ``spec.suspend`` (said as a reason), None when nobody."""
    metadata, trainjob_spec = trainjob_.get("metadata") or {}, trainjob_.get("spec") or {}
    if KUEUE_QUEUE in (metadata.get("labels") or {}) or KUEUE_QUEUE in (metadata.get("annotations") or {}):
        return f"Kueue admits this TrainJob ({KUEUE_QUEUE}): its spec.suspend is Kueue's"
    if trainjob_spec.get("managedBy") not in (None, TRAINER_MANAGER):
        return f"the TrainJob is managed by {trainjob_spec.get('managedBy')}"
    controller = next((o for o in metadata.get("ownerReferences") or [] if o.get("controller")), None)
    if controller is not None:
        return f"the TrainJob is controlled by {controller.get('kind')} {controller.get('name')}, which owns it"
    return None


def _jobset_of(kube: kubernetes.client.ApiClient, owner: Mapping[str, Any]) -> tuple[Group, dict[str, Any]] | None:
    metadata = owner.get("metadata") or {}
    found = trainjob.controlled_jobset(kube, metadata["namespace"], metadata["name"], metadata["uid"])
    if found is None:
        return None
    group = Group(JOBSET.api_version, JOBSET.kind, JOBSET.plural, metadata["namespace"], metadata["name"],
                  found["metadata"]["uid"])  # fmt: skip
    return group, found


class TrainJobLever:
    """The suspend toggle where nobody else owns ``spec.suspend``; else (Kueue) the JobSet's own
    ``failurePolicy`` (``restart_jobset.py``) when the TrainJob's runtime gives its JobSet one that restarts
    the whole group."""

    def refusal(
        self, kube: kubernetes.client.ApiClient, owner: Mapping[str, Any], diagnosis: DiagnosisStatus,
        pods: list[dict[str, Any]], spec: TrainingJobSpec,
    ) -> str | None:  # fmt: skip
        other = suspend_owner(owner)
        if other is not None:
            found = _jobset_of(kube, owner)
            if found is None:
                return f"{other}; no JobSet of it here to restart through its failurePolicy"
            why = JOBSET_LEVER.refusal(kube, found[1], diagnosis, pods, spec)
            return None if why is None else f"{other}; nor through its JobSet: {why}"
        if (owner.get("spec") or {}).get("suspend"):
            return "the TrainJob is suspended already"
        used = restarts_of(owner)
        if used >= spec.recovery.maxRestarts:
            return f"{used} restart(s) of at most {spec.recovery.maxRestarts} used ({RESTARTS_ANNOTATION})"
        return None

    def pull(
        self, kube: kubernetes.client.ApiClient, group: Group, owner: Mapping[str, Any],
        diagnosis: DiagnosisStatus, pods: list[dict[str, Any]], spec: TrainingJobSpec,
    ) -> Pulled:  # fmt: skip
        if suspend_owner(owner) is not None:
            found = _jobset_of(kube, owner)
            if found is None:
                raise LeverRefused("the TrainJob's JobSet is gone")
            return JOBSET_LEVER.pull(kube, found[0], found[1], diagnosis, pods, spec)
        return self._suspend(kube, group, owner, diagnosis, pods, spec)

    def _suspend(
        self, kube: kubernetes.client.ApiClient, group: Group, owner: Mapping[str, Any],
        diagnosis: DiagnosisStatus, pods: list[dict[str, Any]], spec: TrainingJobSpec,
    ) -> Pulled:  # fmt: skip
        restarts = restarts_of(owner) + 1
        patch = {
            "metadata": {
                "resourceVersion": owner["metadata"]["resourceVersion"],
                "annotations": {SUSPENDED_ANNOTATION: diagnosis.time, RESTARTS_ANNOTATION: str(restarts)},
            },
            "spec": {"suspend": True},
        }
        try:
            kubernetes.client.CustomObjectsApi(kube).patch_namespaced_custom_object(
                _API_GROUP, _VERSION, group.namespace, trainjob.TRAINJOB.plural, group.name, patch
            )
        except ApiException as error:
            if error.status == 409:
                raise LeverRefused("the TrainJob changed while rankwatch suspended it") from None
            raise
        done = (
            f"suspended the TrainJob to end every pod of its JobSet, resumed once they are gone (restart "
            f"{restarts} of at most {spec.recovery.maxRestarts})"
        )
        return Pulled(done, frozenset(pod["metadata"]["name"] for pod in pods))


TRAINJOB_LEVER = TrainJobLever()


def _drained(kube: kubernetes.client.ApiClient, namespace: str, name: str, uid: str) -> bool:
    """True once the TrainJob's JobSet is suspended and none of its pods is left (or it has no JobSet)."""
    found = trainjob.controlled_jobset(kube, namespace, name, uid)
    if found is None:
        return True
    if not (found.get("spec") or {}).get("suspend"):
        return False  # the Trainer has not handed the suspend down yet
    selector = f"{jobset.UID_LABEL}={found['metadata']['uid']}"
    return not kubernetes.client.CoreV1Api(kube).list_namespaced_pod(namespace, label_selector=selector).items


def resume_when_drained(kube: kubernetes.client.ApiClient, job: Mapping[str, Any]) -> bool:
    """Resume a TrainJob rankwatch suspended once its JobSet's pods are gone (and drop the mark); True when
    it was resumed now. Blocking."""
    metadata = job.get("metadata") or {}
    namespace, name = metadata["namespace"], metadata["name"]
    if (job.get("spec") or {}).get("suspend") and not _drained(kube, namespace, name, metadata["uid"]):
        return False
    patch: dict[str, Any] = {
        "metadata": {"resourceVersion": metadata["resourceVersion"], "annotations": {SUSPENDED_ANNOTATION: None}},
        "spec": {"suspend": False},
    }
    try:
        kubernetes.client.CustomObjectsApi(kube).patch_namespaced_custom_object(
            _API_GROUP, _VERSION, namespace, trainjob.TRAINJOB.plural, name, patch
        )
    except ApiException as error:
        if error.status in (404, 409):
            return False  # gone, or changed: looked at again
        raise
    log.warning("TrainJob %s/%s: its pods are gone; resumed (restart away from the suspects)", namespace, name)
    return True


def _marked(kube: kubernetes.client.ApiClient, namespace: str, name: str, uid: str) -> dict[str, Any] | None:
    """The TrainJob as stored while it is the same one and still carries the mark, else None."""
    try:
        found = kubernetes.client.CustomObjectsApi(kube).get_namespaced_custom_object(
            _API_GROUP, _VERSION, namespace, trainjob.TRAINJOB.plural, name
        )
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    metadata = found.get("metadata") or {}
    return found if metadata.get("uid") == uid and SUSPENDED_ANNOTATION in (metadata.get("annotations") or {}) else None


async def trainjob_suspended_for_restart(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
    if type == "DELETED" or "kube" not in memo:
        return
    metadata = body.get("metadata") or {}
    namespace, name, uid = metadata.get("namespace", ""), metadata.get("name", ""), metadata.get("uid", "")
    deadline = time.monotonic() + DRAIN_PATIENCE_S
    while memo.leading() and time.monotonic() < deadline:  # not leading: the leader resumes it
        current = await asyncio.to_thread(_marked, memo.kube, namespace, name, uid)
        if current is None or await asyncio.to_thread(resume_when_drained, memo.kube, current):
            return
        await asyncio.sleep(LOOK_AGAIN_S)


def watch_suspended_trainjobs() -> None:
    """Register ``trainjob_suspended_for_restart`` (from the operator's startup, before kopf starts
    watching): only with the admission webhook on, the only case the chart grants a watch on TrainJobs."""
    global _watching
    if _watching:
        return  # a second start in one process: kopf's registry keeps the first
    kopf.on.event(_API_GROUP, _VERSION, trainjob.TRAINJOB.plural, id=RESUME_HANDLER_ID,
                  annotations={SUSPENDED_ANNOTATION: kopf.PRESENT})(trainjob_suspended_for_restart)  # fmt: skip
    _watching = True
