"""Pods of a PyTorchJob (Kubeflow training-operator v1): which group they belong to, each pod's index (the
node rank torchrun gets), the group's size, and what the webhook injects."""

from __future__ import annotations

import copy
from typing import Any

from rankwatch.describe import kind_named
from rankwatch.operator.config import WorkerPodSettings
from rankwatch.operator.kinds import injection
from rankwatch.operator.kinds.pytorchjob import PYTORCHJOB
from rankwatch.operator.kinds.registry import adapter_for
from rankwatch.operator.kinds.restart import lever_of

CONFIG = WorkerPodSettings(image="registry.example/rankwatch:test", collector_url="http://collector:8080")
UID = "4f1e-pytorchjob-uid"


def pytorchjob_pod(replica_type: str = "worker", index: int = 0, master: bool = True) -> dict[str, Any]:
    """A pod as the training-operator v1.8.1 creates it (``createNewPod``, ``setPodEnv``) for PyTorchJob
    ``llama`` with ``nprocPerNode: "4"``, one Master (when ``master``) and two Workers."""
    labels = {
        "training.kubeflow.org/job-name": "llama",
        "training.kubeflow.org/operator-name": "pytorchjob-controller",
        "training.kubeflow.org/replica-type": replica_type,
        "training.kubeflow.org/replica-index": str(index),
    }
    if replica_type == "master":
        labels["training.kubeflow.org/job-role"] = "master"
    env = [{"name": "NCCL_DEBUG", "value": "WARN"}, {"name": "PYTHONUNBUFFERED", "value": "1"}]
    if master:
        node_rank = str(index + 1 if replica_type == "worker" else index)
        env += [
            {"name": "MASTER_PORT", "value": "23456"},
            {"name": "MASTER_ADDR", "value": "llama-master-0"},
            {"name": "WORLD_SIZE", "value": "12"},
            {"name": "RANK", "value": node_rank},
            {"name": "PET_NODE_RANK", "value": node_rank},
        ]
    env += [{"name": "PET_NPROC_PER_NODE", "value": "4"}, {"name": "PET_NNODES", "value": "3" if master else "2"}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"llama-{replica_type}-{index}",
            "namespace": "team-a",
            "labels": labels,
            "annotations": {"rankwatch.io/inject": "true", "rankwatch.io/nproc-per-node": "4"},
            "ownerReferences": [
                {
                    "apiVersion": "kubeflow.org/v1",
                    "kind": "PyTorchJob",
                    "name": "llama",
                    "uid": UID,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "restartPolicy": "OnFailure",
            "containers": [
                {"name": "pytorch", "image": "pytorch/pytorch:2.13.0", "command": ["torchrun", "train.py"], "env": env}
            ],
        },
    }


def test_a_pytorchjob_pod_belongs_to_the_pytorchjob_controlling_it():
    adapter, group = adapter_for(pytorchjob_pod())
    assert adapter is PYTORCHJOB and (group.kind, group.namespace, group.name, group.uid) == (
        "PyTorchJob", "team-a", "llama", UID,
    )  # fmt: skip
    assert (group.api_version, group.plural) == ("kubeflow.org/v1", "pytorchjobs")
    assert group.collector_name == "PyTorchJob:llama"
    assert group.event_target.kind == "PyTorchJob" and group.event_target.uid == UID, "Events on the PyTorchJob"
    key, value = adapter.pod_selector(group).split("=")
    assert pytorchjob_pod()["metadata"]["labels"][key] == value
    assert adapter.token_secret_name("llama") == "llama-rankwatch-pytorchjob-token"


def test_the_index_is_the_node_rank_the_training_operator_gives_torchrun():
    assert PYTORCHJOB.index_of(pytorchjob_pod("master", 0)) == 0
    for index in (0, 1, 7):
        pod = pytorchjob_pod("worker", index)
        [node_rank] = [e["value"] for e in pod["spec"]["containers"][0]["env"] if e["name"] == "PET_NODE_RANK"]
        assert PYTORCHJOB.index_of(pod) == int(node_rank) == index + 1


def test_without_a_master_the_index_is_the_workers_replica_index():
    """No Master: the training-operator sets no node rank (torchrun's rendezvous numbers the nodes)."""
    assert [PYTORCHJOB.index_of(pytorchjob_pod("worker", i, master=False)) for i in (0, 1)] == [0, 1]


def test_the_group_size_is_master_plus_workers():
    spec = {"pytorchReplicaSpecs": {"Master": {"replicas": 1}, "Worker": {"replicas": 15}}}
    assert PYTORCHJOB.expected_size({"spec": spec}) == 16
    assert PYTORCHJOB.expected_size({"spec": {"pytorchReplicaSpecs": {"Master": {}, "Worker": {}}}}) == 2, "default 1"
    assert PYTORCHJOB.expected_size({"spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 4}}}}) == 4
    for hostile in ({}, {"spec": None}, {"spec": {"pytorchReplicaSpecs": []}}, {"spec": {"pytorchReplicaSpecs": {}}},
                    {"spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": "4"}}}},
                    {"spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": True}}}},
                    {"spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 0}}}}):  # fmt: skip
        assert PYTORCHJOB.expected_size(hostile) is None, hostile


def test_bad_or_missing_labels_name_no_pytorchjob_and_never_crash():
    orphan = pytorchjob_pod()
    orphan["metadata"]["ownerReferences"] = []
    assert PYTORCHJOB.group_of(orphan) is None, "a pod no PyTorchJob controls is none's, whatever its labels say"
    renamed = pytorchjob_pod()
    renamed["metadata"]["labels"]["training.kubeflow.org/job-name"] = "other"
    assert PYTORCHJOB.group_of(renamed) is None, "its label and its controller disagree"
    unlabelled = pytorchjob_pod()
    unlabelled["metadata"]["labels"] = None
    assert PYTORCHJOB.group_of(unlabelled) is None
    not_controller = pytorchjob_pod()
    not_controller["metadata"]["ownerReferences"][0]["controller"] = False
    assert PYTORCHJOB.group_of(not_controller) is None
    assert PYTORCHJOB.group_of({}) is None and PYTORCHJOB.index_of({}) is None
    for replica_type, index in (("ps", "0"), ("worker", "x"), ("worker", "-1"), ("worker", ""), ("master", "1")):
        pod = pytorchjob_pod()
        pod["metadata"]["labels"]["training.kubeflow.org/replica-type"] = replica_type
        pod["metadata"]["labels"]["training.kubeflow.org/replica-index"] = index
        assert PYTORCHJOB.index_of(pod) is None, (replica_type, index)


def env_of(container: dict) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container.get("env", [])}


def test_the_webhook_injects_a_pytorchjob_pod_with_its_group_and_node_rank():
    pod = pytorchjob_pod("worker", 1)
    decision = injection.plan(pod)
    assert isinstance(decision, injection.Injection), decision
    after = injection.injected_pod(pod, decision, CONFIG)
    sidecar = env_of(next(c for c in after["spec"]["initContainers"] if c["name"] == "rankwatch-sidecar"))
    assert sidecar["RANKWATCH_JOB_NAME"] == "PyTorchJob:llama"
    assert sidecar["RANKWATCH_REPLICA_INDEX"] == "2", "Worker 1 is node rank 2"
    volumes = {v["name"]: v for v in after["spec"]["volumes"]}
    assert volumes["rankwatch-token"]["secret"]["secretName"] == "llama-rankwatch-pytorchjob-token"
    assert after["spec"]["containers"][0]["name"] == "pytorch"


def test_a_pytorchjob_pod_with_no_valid_index_is_left_uninjected_with_the_reason():
    pod = copy.deepcopy(pytorchjob_pod())
    pod["metadata"]["labels"]["training.kubeflow.org/replica-type"] = "launcher"
    decision = injection.plan(pod)
    assert isinstance(decision, injection.NotInjected) and decision.asked
    assert decision.reason.startswith("PyTorchJob team-a/llama: the pod says no valid index")


def test_a_pytorchjob_is_restarted_with_its_suspend_toggle():
    assert PYTORCHJOB.restart_lever == "runPolicy.suspend toggle" and lever_of("PyTorchJob") is not None


def test_rankwatch_describe_takes_pytorchjob():
    assert kind_named("pytorchjob").api_version == kind_named("PyTorchJobs").api_version == "kubeflow.org/v1"
