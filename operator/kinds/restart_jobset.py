"""A JobSet's restart lever: its own ``failurePolicy``, reached through the one door its controller
offers, a failed child Job.

What the JobSet controller (v0.12, ``pkg/controllers/failure_policy.go``) does on a restart: when a child
Job has the ``Failed`` condition it takes the first ``failurePolicy.rules`` entry matching that Job's
failure reason, message and replicatedJob (none: ``RestartJobSet``); ``RestartJobSet`` bumps
``status.restarts`` and ``restartsCountTowardsMax`` (or fails the JobSet once that reached
``maxRestarts``), and the next reconcile deletes every child Job whose
``jobset.sigs.k8s.io/restart-attempt`` is below ``status.restarts`` and creates them anew with the new
attempt: the whole group, rescheduled, so away from the cordoned suspects. Deleting a pod does not do it
(jobset#574: the Job makes the pod again, within ``backoffLimit``), nor can a client write the
controller's status without racing it and skipping ``maxRestarts``.

So rankwatch fails the child Job that holds the suspect's pod, by setting its ``activeDeadlineSeconds``
to 1 (mutable on a running Job): the Job controller ends its pods and marks it Failed with reason
``DeadlineExceeded``, whatever ``backoffLimit`` and ``podFailurePolicy`` say. Before pulling, the same
rule matching is done here, and the lever is refused (cordon and page only) unless the JobSet's answer
to that failure is a whole-group restart within its limit: no ``failurePolicy`` (a failed Job fails
the JobSet), a rule answering ``FailJobSet`` or ``RestartJob`` (one Job only), or ``maxRestarts`` used.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch.model.diagnosis_status import DiagnosisStatus
from rankwatch.operator.kinds.adapter import Group
from rankwatch.operator.kinds.lever import LeverRefused, Pulled
from rankwatch.operator.spec import TrainingJobSpec

FAILURE_REASON = "DeadlineExceeded"
FAILURE_MESSAGE = "Job was active longer than specified deadline"
"""What the Job controller writes on the Failed condition of a Job past its activeDeadlineSeconds."""
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
WHOLE_GROUP = ("RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts")


def _matches(patterns: list[str], message: str) -> bool:
    for pattern in patterns:
        try:
            if re.search(pattern, message):
                return True
        except re.error:
            continue  # as the controller: an invalid pattern matches nothing
    return False


def failure_answer(failure_policy: Mapping[str, Any], replicated_job: str) -> tuple[str, str]:
    """The action the JobSet controller takes when a child Job of ``replicated_job`` fails with the
    deadline's reason and message, and the rule's name ('' for the default)."""
    for rule in failure_policy.get("rules") or []:
        reasons = rule.get("onJobFailureReasons") or []
        patterns = rule.get("onJobFailureMessagePatterns") or []
        targets = rule.get("targetReplicatedJobs") or []
        if reasons and FAILURE_REASON not in reasons:
            continue
        if patterns and not _matches(patterns, FAILURE_MESSAGE):
            continue
        if targets and replicated_job not in targets:
            continue
        return str(rule.get("action", "")), str(rule.get("name", ""))
    return "RestartJobSet", ""


def restarts_counted(status: Mapping[str, Any]) -> int:
    """``restartsCountTowardsMax`` plus every Job's individual counted restarts (the controller's total)."""
    total = int(status.get("restartsCountTowardsMax") or 0)
    for replicated in status.get("replicatedJobsStatus") or []:
        total += sum(int(count or 0) for count in replicated.get("jobRestartsCountTowardsMax") or [])
    return total


def _suspect_job(owner: Mapping[str, Any], diagnosis: DiagnosisStatus, pods: list[dict[str, Any]]) -> str | None:
    """The child Job (name) of the current attempt controlling the first named pod still in the group."""
    attempt = str((owner.get("status") or {}).get("restarts") or 0)
    by_name = {pod["metadata"]["name"]: pod for pod in pods}
    for name in diagnosis.pods:
        pod = by_name.get(name)
        if pod is None or (pod["metadata"].get("labels") or {}).get(RESTART_ATTEMPT_LABEL) != attempt:
            continue
        controller = next((o for o in pod["metadata"].get("ownerReferences") or [] if o.get("controller")), None)
        if controller is not None and controller.get("kind") == "Job":
            return str(controller["name"])
    return None


class FailurePolicyLever:
    def refusal(
        self, kube: kubernetes.client.ApiClient, owner: Mapping[str, Any], diagnosis: DiagnosisStatus,
        pods: list[dict[str, Any]], spec: TrainingJobSpec,
    ) -> str | None:  # fmt: skip
        jobset_spec, status = owner.get("spec") or {}, owner.get("status") or {}
        if jobset_spec.get("suspend"):
            return "the JobSet is suspended"
        policy = jobset_spec.get("failurePolicy")
        if not policy:
            return "the JobSet has no spec.failurePolicy (a failed child Job would fail the whole JobSet)"
        job = _suspect_job(owner, diagnosis, pods)
        if job is None:
            return "none of the pods the diagnosis names runs in this attempt of the JobSet"
        replicated = next(
            ((p["metadata"].get("labels") or {}).get(REPLICATED_JOB_LABEL, "") for p in pods
             if any(o.get("name") == job for o in p["metadata"].get("ownerReferences") or [])), "",
        )  # fmt: skip
        action, rule = failure_answer(policy, replicated)
        if action not in WHOLE_GROUP:
            return f"its failurePolicy rule {rule!r} answers a failed Job ({FAILURE_REASON}) with {action}"
        limit, used = int(policy.get("maxRestarts") or 0), restarts_counted(status)
        if action == "RestartJobSet" and used >= limit:
            return f"{used} restart(s) of at most {limit} used (failurePolicy.maxRestarts)"
        return None

    def pull(
        self, kube: kubernetes.client.ApiClient, group: Group, owner: Mapping[str, Any],
        diagnosis: DiagnosisStatus, pods: list[dict[str, Any]], spec: TrainingJobSpec,
    ) -> Pulled:  # fmt: skip
        job = _suspect_job(owner, diagnosis, pods)
        if job is None:
            raise LeverRefused("the suspect's child Job is gone")
        batch = kubernetes.client.BatchV1Api(kube)
        current = batch.read_namespaced_job(job, group.namespace)
        attempt = str((owner.get("status") or {}).get("restarts") or 0)
        if (current.metadata.labels or {}).get(RESTART_ATTEMPT_LABEL) != attempt or not any(
            o.controller and o.uid == group.uid for o in current.metadata.owner_references or []
        ):
            raise LeverRefused(f"child Job {job} is no longer of this attempt of the JobSet")
        patch = {
            "metadata": {"resourceVersion": current.metadata.resource_version},
            "spec": {"activeDeadlineSeconds": 1},
        }
        try:
            batch.patch_namespaced_job(job, group.namespace, patch)
        except ApiException as error:
            if error.status == 409:
                raise LeverRefused(f"child Job {job} changed while rankwatch ended it") from None
            raise
        policy = (owner.get("spec") or {}).get("failurePolicy") or {}
        replicated = (current.metadata.labels or {}).get(REPLICATED_JOB_LABEL, "")
        counted = failure_answer(policy, replicated)[0] == "RestartJobSet"
        limit = (
            f"restart {restarts_counted(owner.get('status') or {}) + 1} of at most {policy.get('maxRestarts', 0)}"
            if counted
            else "not counted against maxRestarts: RestartJobSetAndIgnoreMaxRestarts"
        )
        done = f"ended child Job {job} (activeDeadlineSeconds): the JobSet's failurePolicy recreates every child Job"
        return Pulled(f"{done} ({limit})", frozenset(pod["metadata"]["name"] for pod in pods))


JOBSET_LEVER = FailurePolicyLever()
