"""A Volcano Job's restart lever: a ``bus.volcano.sh/v1alpha1`` ``Command`` with action ``RestartJob``,
exactly as ``vcctl job restart`` makes it (volcano v1.10.0, ``pkg/cli/job/util.go`` createJobCommand):
owned by the Job and aimed at it by a controller reference (``target``). Volcano's job controller takes
only Commands whose target is a ``batch.volcano.sh/v1alpha1`` ``Job``, deletes each before acting on it
(so it runs once), and restarts the whole Job: every pod killed and made again, ``status.retryCount``
+ 1, the Job failed once that reaches ``spec.maxRetry`` (default 3), so refused here past it.

The Command's name is fixed by the diagnosis (``<job>-restartjob-<digest>``, vcctl's prefix): a second
create for the same diagnosis is refused by the API server (409) rather than restarting again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch.model.diagnosis_status import DiagnosisStatus
from rankwatch.operator.kinds.adapter import Group
from rankwatch.operator.kinds.lever import LeverRefused, Pulled
from rankwatch.operator.spec import TrainingJobSpec

BUS = ("bus.volcano.sh", "v1alpha1", "commands")
RESTART_JOB = "RestartJob"
"""``busv1alpha1.RestartJobAction`` (volcano.sh/apis ``pkg/apis/bus/v1alpha1/actions.go``)."""
DEFAULT_MAX_RETRY = 3
"""The Job CRD's default ``spec.maxRetry``."""
ENDED_PHASES = ("Completed", "Failed", "Terminated", "Aborted")


def command_name(job: str, uid: str, diagnosis_time: str) -> str:
    digest = hashlib.sha256(f"{uid}/{diagnosis_time}".encode()).hexdigest()[:8]
    return f"{job}-{RESTART_JOB.lower()}-{digest}"


def restart_command(owner: Mapping[str, Any], diagnosis: DiagnosisStatus) -> dict[str, Any]:
    """The Command vcctl makes for ``RestartJob`` on ``owner``, named after the diagnosis and saying why."""
    metadata = owner["metadata"]
    target = {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": metadata["name"],
        "uid": metadata["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    return {
        "apiVersion": f"{BUS[0]}/{BUS[1]}",
        "kind": "Command",
        "metadata": {
            "name": command_name(metadata["name"], metadata["uid"], diagnosis.time),
            "namespace": metadata["namespace"],
            "ownerReferences": [target],
        },
        "action": RESTART_JOB,
        "target": target,
        "reason": diagnosis.reason or "Diagnosis",
        "message": f"rankwatch: {diagnosis.summary}"[:1024],
    }


class RestartJobCommand:
    def refusal(
        self, kube: kubernetes.client.ApiClient, owner: Mapping[str, Any], diagnosis: DiagnosisStatus,
        pods: list[dict[str, Any]], spec: TrainingJobSpec,
    ) -> str | None:  # fmt: skip
        status = owner.get("status") or {}
        phase = (status.get("state") or {}).get("phase")
        if phase in ENDED_PHASES:
            return f"the Job is {phase}"
        limit = (owner.get("spec") or {}).get("maxRetry", DEFAULT_MAX_RETRY)
        used = int(status.get("retryCount") or 0)
        if isinstance(limit, int) and used >= limit:
            return f"{used} retries of at most {limit} used (spec.maxRetry)"
        return None

    def pull(
        self, kube: kubernetes.client.ApiClient, group: Group, owner: Mapping[str, Any],
        diagnosis: DiagnosisStatus, pods: list[dict[str, Any]], spec: TrainingJobSpec,
    ) -> Pulled:  # fmt: skip
        command = restart_command(owner, diagnosis)
        try:
            kubernetes.client.CustomObjectsApi(kube).create_namespaced_custom_object(
                BUS[0], BUS[1], group.namespace, BUS[2], command
            )
        except ApiException as error:
            if error.status == 404:
                raise LeverRefused("no bus.volcano.sh Commands served here (Volcano not installed?)") from None
            if error.status != 409:
                raise
        name = command["metadata"]["name"]
        # Volcano makes the new pods under the same names: none of the old ones' is ignored.
        return Pulled(f"created Volcano Command {name} (RestartJob): Volcano restarts the whole Job", frozenset())


VOLCANO_LEVER = RestartJobCommand()
