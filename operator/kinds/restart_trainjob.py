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

The two steps (suspend and mark; resume once no pod of its JobSet is left) are ``suspend_toggle.py``'s.
The TrainJob's status follows its JobSet's Jobs, not their pods, so its last change may come while the
pods still terminate: the toggle's handler looks again until they are gone.

Where someone else owns ``spec.suspend`` (Kueue, when it admits the TrainJob: label
``kueue.x-k8s.io/queue-name``; MultiKueue: ``spec.managedBy``; a controller that owns the TrainJob) the
suspend is never touched: the group is restarted through its JobSet's ``failurePolicy`` when the runtime
gives the JobSet one answering a failed child Job with a whole-group restart within its ``maxRestarts``
(Kueue keeps the workload admitted through it), else cordon and page only. Also refused when the TrainJob
is suspended already, or past ``rankwatch.io/max-restarts`` suspends (counted in ``rankwatch.io/restarts``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kubernetes

from rankwatch.model.diagnosis_status import DiagnosisStatus
from rankwatch.operator.kinds import jobset, trainjob
from rankwatch.operator.kinds.adapter import Group
from rankwatch.operator.kinds.jobset import JOBSET
from rankwatch.operator.kinds.lever import LeverRefused, Pulled
from rankwatch.operator.kinds.restart_jobset import JOBSET_LEVER
from rankwatch.operator.kinds.suspend_toggle import CustomObjects, SuspendToggle
from rankwatch.operator.spec import TrainingJobSpec

TRAINER_MANAGER = "trainer.kubeflow.org/trainjob-controller"
"""``spec.managedBy`` of a TrainJob the Trainer itself reconciles (its default)."""


def _drained(kube: kubernetes.client.ApiClient, job: Mapping[str, Any]) -> bool:
    """True once the TrainJob's JobSet is suspended and none of its pods is left (or it has no JobSet)."""
    metadata = job["metadata"]
    found = trainjob.controlled_jobset(kube, metadata["namespace"], metadata["name"], metadata["uid"])
    if found is None:
        return True
    if not (found.get("spec") or {}).get("suspend"):
        return False  # the Trainer has not handed the suspend down yet
    selector = f"{jobset.UID_LABEL}={found['metadata']['uid']}"
    pods = kubernetes.client.CoreV1Api(kube).list_namespaced_pod(metadata["namespace"], label_selector=selector)
    return not pods.items


TRAINJOBS = CustomObjects(trainjob.API_VERSION, trainjob.TRAINJOB.plural)
TOGGLE = SuspendToggle("TrainJob", TRAINJOBS, ("suspend",), _drained, "rankwatch-resume-suspended-trainjob")


def suspend_owner(trainjob_: Mapping[str, Any]) -> str | None:
    """Who other than the Trainer owns the TrainJob's ``spec.suspend`` (said as a reason), None when nobody."""
    other = TOGGLE.owner_of_suspend(trainjob_)  # Kueue, or a controller owning the TrainJob
    managed_by = (trainjob_.get("spec") or {}).get("managedBy")
    if other is None and managed_by not in (None, TRAINER_MANAGER):
        return f"the TrainJob is managed by {managed_by}"
    return other


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
        return TOGGLE.refusal_of_state(owner, spec)

    def pull(
        self, kube: kubernetes.client.ApiClient, group: Group, owner: Mapping[str, Any],
        diagnosis: DiagnosisStatus, pods: list[dict[str, Any]], spec: TrainingJobSpec,
    ) -> Pulled:  # fmt: skip
        if suspend_owner(owner) is not None:
            found = _jobset_of(kube, owner)
            if found is None:
                raise LeverRefused("the TrainJob's JobSet is gone")
            return JOBSET_LEVER.pull(kube, found[0], found[1], diagnosis, pods, spec)
        done = TOGGLE.suspend(kube, group, owner, diagnosis, spec)
        return Pulled(done, frozenset(pod["metadata"]["name"] for pod in pods))


TRAINJOB_LEVER = TrainJobLever()
watch_suspended_trainjobs = TOGGLE.watch
