"""A Volcano Job (``batch.volcano.sh/v1alpha1`` Job, volcano-sh/volcano): its controller makes each pod
itself (``<job>-<task>-<index>``), controlled by the Job, labelled ``volcano.sh/job-name``,
``task-spec`` and ``task-index``. rankwatch names the kind ``VolcanoJob`` (its kind is ``Job``, like a
``batch/v1`` Job's): in the collector name, the token Secret, the report and the alert's ``jobkind``.

- group: the Volcano Job that controls the pod (its controller reference);
- size: the sum of its tasks' ``replicas``;
- index: the pod's ``volcano.sh/task-index`` within its task, for the sidecar's log lines; ranks come
  from torchrun's (or Volcano's pytorch plugin's) RANK / WORLD_SIZE in each process;
- restart lever: Volcano's own ``bus.volcano.sh`` Command ``RestartJob`` (``restart_volcano.py``), as
  ``vcctl job restart`` makes it, within the Job's ``maxRetry``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kubernetes

from rankwatch.operator import api
from rankwatch.operator.kinds.adapter import Group, annotation_field, annotation_index, owned_by, pods_claimed
from rankwatch.operator.lifecycle.pod_spec import FieldPath

API_VERSION = "batch.volcano.sh/v1alpha1"
JOB_NAME_LABEL = "volcano.sh/job-name"
TASK_INDEX = "volcano.sh/task-index"


class VolcanoJob:
    kind = "Job"
    key = "VolcanoJob"
    api_version = API_VERSION
    plural = "jobs"
    restart_lever: str | None = "bus.volcano.sh Command RestartJob"

    def group_of(self, pod: Mapping[str, Any]) -> Group | None:
        owner = owned_by(pod, API_VERSION, "Job")
        if owner is None or not owner.get("name") or not owner.get("uid"):
            return None
        namespace = pod.get("metadata", {}).get("namespace", "")
        return Group(API_VERSION, self.kind, self.plural, namespace, owner["name"], owner["uid"], self.key)

    def index_of(self, pod: Mapping[str, Any]) -> int | None:
        return annotation_index(pod, TASK_INDEX)

    def index_field(self) -> FieldPath:
        return annotation_field(TASK_INDEX)

    def expected_size(self, owner: Mapping[str, Any]) -> int | None:
        replicas = [task.get("replicas", 1) for task in (owner.get("spec") or {}).get("tasks") or []]
        if not replicas or not all(isinstance(count, int) and count >= 0 for count in replicas):
            return None
        return sum(replicas) or None

    def pod_selector(self, group: Group) -> str:
        return f"{JOB_NAME_LABEL}={group.name}"

    def token_secret_name(self, name: str) -> str:
        return api.kind_token_secret_name(self.key, name)

    def member_pods(self, kube: kubernetes.client.ApiClient, group: Group) -> list[dict[str, Any]]:
        # group_of names the pod's controlling Volcano Job: its uid is the group's.
        return pods_claimed(kube, self, group)


VOLCANO_JOB = VolcanoJob()
