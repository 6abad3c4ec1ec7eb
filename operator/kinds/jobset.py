"""A JobSet (``jobset.x-k8s.io/v1alpha2``, kubernetes-sigs/jobset): one child Job per replica of each
replicatedJob, its pods labelled with the JobSet's name and uid. A TrainJob (Kubeflow Trainer v2) runs
as a JobSet of the same name; its pods are the TrainJob's (``trainjob.py``) once the webhook marked them.

- group: the JobSet the pod's labels name (``jobset.sigs.k8s.io/jobset-name``, ``jobset-uid``); the
  pod's controller must be a Job, and only pods whose Job the JobSet itself controls are members
  (``member_pods``): labels are whatever a pod's creator writes;
- size: the sum over ``spec.replicatedJobs`` of ``replicas`` x the Job template's ``parallelism``;
- index: the Job's completion index (``batch.kubernetes.io/job-completion-index``), for the sidecar's
  log lines; ranks come from torchrun's RANK / WORLD_SIZE in each process;
- restart lever: the JobSet's own ``failurePolicy`` (``restart_jobset.py``): rankwatch fails the
  suspect's child Job, the controller recreates every child Job (within ``maxRestarts``), and the
  cordoned suspect node keeps the new pods off it. Deleting a pod does not restart the group (jobset#574).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kubernetes

from rankwatch.operator import api
from rankwatch.operator.kinds.adapter import Group, annotation_field, annotation_index, owned_by, pods_claimed
from rankwatch.operator.kinds.indexed_job import COMPLETION_INDEX
from rankwatch.operator.lifecycle.pod_spec import FieldPath

API_VERSION = "jobset.x-k8s.io/v1alpha2"
NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
UID_LABEL = "jobset.sigs.k8s.io/jobset-uid"


class JobSetAdapter:
    kind = "JobSet"
    key = "JobSet"
    api_version = API_VERSION
    plural = "jobsets"
    restart_lever: str | None = "failurePolicy (a failed child Job)"

    def group_of(self, pod: Mapping[str, Any]) -> Group | None:
        metadata = pod.get("metadata", {})
        labels = metadata.get("labels") or {}
        name, uid = labels.get(NAME_LABEL), labels.get(UID_LABEL)
        if not name or not uid or owned_by(pod, "batch/v1", "Job") is None:
            return None
        return Group(self.api_version, self.kind, self.plural, metadata.get("namespace", ""), name, uid)

    def index_of(self, pod: Mapping[str, Any]) -> int | None:
        return annotation_index(pod, COMPLETION_INDEX)

    def index_field(self) -> FieldPath:
        return annotation_field(COMPLETION_INDEX)

    def expected_size(self, owner: Mapping[str, Any]) -> int | None:
        total = 0
        for replicated in (owner.get("spec") or {}).get("replicatedJobs") or []:
            replicas = replicated.get("replicas", 1)
            parallelism = (((replicated.get("template") or {}).get("spec") or {}).get("parallelism", 1))  # fmt: skip
            if not isinstance(replicas, int) or not isinstance(parallelism, int):
                return None
            total += max(0, replicas) * max(0, parallelism)
        return total or None

    def pod_selector(self, group: Group) -> str:
        return f"{UID_LABEL}={group.uid}"

    def token_secret_name(self, name: str) -> str:
        return api.kind_token_secret_name(self.key, name)

    def member_pods(self, kube: kubernetes.client.ApiClient, group: Group) -> list[dict[str, Any]]:
        jobs = kubernetes.client.BatchV1Api(kube).list_namespaced_job(
            group.namespace, label_selector=f"{UID_LABEL}={group.uid}"
        )
        children = frozenset(job.metadata.uid for job in jobs.items if _controlled_by(job, group))
        return pods_claimed(kube, self, group, children)


def _controlled_by(job: kubernetes.client.V1Job, group: Group) -> bool:
    references = job.metadata.owner_references or []
    return any(o.controller and o.kind == "JobSet" and o.uid == group.uid for o in references)


JOBSET = JobSetAdapter()
