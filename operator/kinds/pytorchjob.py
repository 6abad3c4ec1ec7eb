"""A PyTorchJob (``kubeflow.org/v1``, the Kubeflow training-operator v1): the training-operator makes one pod
per replica of each replica type (``<job>-master-0``, ``<job>-worker-<i>``), controlled by the PyTorchJob
and labelled ``training.kubeflow.org/job-name``, ``replica-type`` (``master`` / ``worker``) and
``replica-index``.

- group: the PyTorchJob controlling the pod (its owner reference, of the name the job-name label says);
- size: the sum of ``replicas`` over ``spec.pytorchReplicaSpecs`` (Master and Worker; 1 when unset, the
  controller's default);
- index: the node rank the training-operator gives torchrun (``PET_NODE_RANK``, also ``RANK``) when the
  job has a Master: the Master 0, Worker ``i`` node ``i + 1``; without a Master (elastic), torchrun's
  rendezvous numbers the nodes at run time and the index is the Worker's replica index. Known at
  admission (the labels are on the pod the controller creates), so it is given to the sidecar as a value;
  ranks come from torchrun's RANK / WORLD_SIZE in each process;
- restart lever: the ``spec.runPolicy.suspend`` toggle (``restart_pytorchjob.py``); not where Kueue admits
  the job (then cordon and page only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kubernetes

from rankwatch.operator import api
from rankwatch.operator.kinds.adapter import Group, owned_by, pods_claimed
from rankwatch.operator.lifecycle.pod_spec import FieldPath

API_VERSION = "kubeflow.org/v1"
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
MASTER, WORKER = "master", "worker"
CONTAINER = "pytorch"
"""The container the training-operator sets torchrun's environment in (its ``PyTorchJobDefaultContainerName``)."""
NODE_RANK_ENV = "PET_NODE_RANK"


class PyTorchJobAdapter:
    kind = "PyTorchJob"
    key = "PyTorchJob"
    api_version = API_VERSION
    plural = "pytorchjobs"
    restart_lever: str | None = "runPolicy.suspend toggle"

    def group_of(self, pod: Mapping[str, Any]) -> Group | None:
        metadata = pod.get("metadata", {})
        name = (metadata.get("labels") or {}).get(JOB_NAME_LABEL)
        owner = owned_by(pod, self.api_version, self.kind)
        if not name or owner is None or owner.get("name") != name or not owner.get("uid"):
            return None
        return Group(self.api_version, self.kind, self.plural, metadata.get("namespace", ""), name, owner["uid"])

    def index_of(self, pod: Mapping[str, Any]) -> int | None:
        labels = pod.get("metadata", {}).get("labels") or {}
        replica_type, index = labels.get(REPLICA_TYPE_LABEL), labels.get(REPLICA_INDEX_LABEL, "")
        if replica_type not in (MASTER, WORKER) or not index.isdigit():
            return None
        if replica_type == MASTER:
            return 0 if index == "0" else None  # a PyTorchJob has one Master
        return int(index) + 1 if _node_rank_set(pod) else int(index)

    def index_field(self) -> FieldPath | None:
        return None  # known at admission: index_of

    def expected_size(self, owner: Mapping[str, Any]) -> int | None:
        specs = (owner.get("spec") or {}).get("pytorchReplicaSpecs")
        if not isinstance(specs, Mapping):
            return None
        total = 0
        for spec in specs.values():
            replicas = (spec or {}).get("replicas", 1)
            if not isinstance(replicas, int) or isinstance(replicas, bool):
                return None
            total += max(0, replicas)
        return total or None

    def pod_selector(self, group: Group) -> str:
        return f"{JOB_NAME_LABEL}={group.name}"

    def token_secret_name(self, name: str) -> str:
        return api.kind_token_secret_name(self.key, name)

    def member_pods(self, kube: kubernetes.client.ApiClient, group: Group) -> list[dict[str, Any]]:
        # group_of names the pod's controlling PyTorchJob: its uid is the group's.
        return pods_claimed(kube, self, group)


def _node_rank_set(pod: Mapping[str, Any]) -> bool:
    """The training-operator set torchrun's node rank on the pod: it does when the job has a Master."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") == CONTAINER:
            return any(variable.get("name") == NODE_RANK_ENV for variable in container.get("env") or [])
    return False


PYTORCHJOB = PyTorchJobAdapter()
