"""A plain Indexed Job (``batch/v1`` Job, ``completionMode: Indexed``): one pod per completion index.

- group: the Job (the pod's controlling owner); pods of a JobSet's child Jobs are the JobSet's, not
  claimed here;
- size: ``spec.completions`` (an Indexed Job has one pod per index; a training job runs them all at once);
- index: the annotation ``batch.kubernetes.io/job-completion-index`` (also ``JOB_COMPLETION_INDEX``);
- restart lever: the ``spec.suspend`` toggle (``restart_indexed_job.py``): every pod ended, then new ones
  away from the cordoned suspects. Not where Kueue admits the Job (``spec.suspend`` is Kueue's) or a
  controller owns it: cordon and page only. Deleting a pod would restart that index only, its peers
  waiting in the old rendezvous.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kubernetes

from rankwatch.operator import api
from rankwatch.operator.kinds.adapter import Group, annotation_field, annotation_index, owned_by, pods_claimed
from rankwatch.operator.lifecycle.pod_spec import FieldPath

COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
CONTROLLER_UID_LABEL = "batch.kubernetes.io/controller-uid"
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"


class IndexedJob:
    kind = "Job"
    key = "Job"
    api_version = "batch/v1"
    plural = "jobs"
    restart_lever: str | None = "spec.suspend toggle"

    def group_of(self, pod: Mapping[str, Any]) -> Group | None:
        metadata = pod.get("metadata", {})
        if COMPLETION_INDEX not in (metadata.get("annotations") or {}):
            return None  # not Indexed: its pods have no place in a group
        if JOBSET_LABEL in (metadata.get("labels") or {}):
            return None  # a JobSet's child Job: the group is the JobSet
        owner = owned_by(pod, "batch/v1", "Job")
        if owner is None or not owner.get("name") or not owner.get("uid"):
            return None
        return Group(
            self.api_version, self.kind, self.plural, metadata.get("namespace", ""), owner["name"], owner["uid"]
        )

    def index_of(self, pod: Mapping[str, Any]) -> int | None:
        return annotation_index(pod, COMPLETION_INDEX)

    def index_field(self) -> FieldPath:
        return annotation_field(COMPLETION_INDEX)

    def expected_size(self, owner: Mapping[str, Any]) -> int | None:
        completions = (owner.get("spec") or {}).get("completions")
        return completions if isinstance(completions, int) and completions > 0 else None

    def pod_selector(self, group: Group) -> str:
        return f"{CONTROLLER_UID_LABEL}={group.uid}"

    def token_secret_name(self, name: str) -> str:
        return api.kind_token_secret_name(self.key, name)

    def member_pods(self, kube: kubernetes.client.ApiClient, group: Group) -> list[dict[str, Any]]:
        # group_of names the pod's controlling Job: its uid is the group's.
        return pods_claimed(kube, self, group)


INDEXED_JOB = IndexedJob()
