"""Pods of a TrainJob (Kubeflow Trainer v2): which group they belong to, their index, the group's size,
and what the webhook writes on them (the TrainJob's uid, which nothing else on the pod carries)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import jsonpatch
import kopf
import kubernetes

from rankwatch.describe import kind_named
from rankwatch.operator.config import WorkerPodSettings
from rankwatch.operator.kinds import webhook
from rankwatch.operator.kinds.adapter import group_size
from rankwatch.operator.kinds.jobset import JOBSET
from rankwatch.operator.kinds.registry import adapter_for
from rankwatch.operator.kinds.trainjob import TRAINJOB, TRAINJOB_UID_ANNOTATION, runtime_nodes
from rankwatch.operator.lifecycle import pod_spec

CONFIG = WorkerPodSettings(image="registry.example/rankwatch:test", collector_url="http://collector:8080")
TRAINJOB_UID = "537c-trainjob-uid"
JOBSET_UID = "b62d-jobset-uid"


def trainjob_pod(completion_index: int = 1, **annotations: str) -> dict[str, Any]:
    """A pod as the Job controller makes it for a TrainJob's JobSet (labels as the Trainer v2.3 / JobSet
    v0.12 controllers set them, seen on the local cluster), its template opted in by a runtime patch."""
    index = str(completion_index)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": f"llama-node-0-{index}-",
            "namespace": "team-a",
            "labels": {
                "batch.kubernetes.io/job-completion-index": index,
                "batch.kubernetes.io/job-name": "llama-node-0",
                "jobset.sigs.k8s.io/jobset-name": "llama",
                "jobset.sigs.k8s.io/jobset-uid": JOBSET_UID,
                "jobset.sigs.k8s.io/replicatedjob-name": "node",
                "jobset.sigs.k8s.io/job-index": "0",
            },
            "annotations": {
                "batch.kubernetes.io/job-completion-index": index,
                "rankwatch.io/inject": "true",
                "rankwatch.io/nproc-per-node": "4",
                **annotations,
            },
            "ownerReferences": [
                {"apiVersion": "batch/v1", "kind": "Job", "name": "llama-node-0", "uid": "job-0", "controller": True}
            ],
        },
        "spec": {
            "restartPolicy": "OnFailure",
            "containers": [
                {
                    "name": "node",
                    "image": "pytorch/pytorch:2.13.0",
                    "command": ["torchrun", "train.py"],
                    "env": [
                        {"name": "PET_NNODES", "value": "2"},
                        {
                            "name": "PET_NODE_RANK",
                            "valueFrom": {
                                "fieldRef": {
                                    "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
                                }
                            },
                        },
                    ],
                }
            ],
        },
    }


def stamped(pod: dict[str, Any], uid: str = TRAINJOB_UID) -> dict[str, Any]:
    """``pod`` as the webhook admits it once it found the TrainJob controlling its JobSet."""
    result = copy.deepcopy(pod)
    result["metadata"]["annotations"][TRAINJOB_UID_ANNOTATION] = uid
    return result


def test_a_trainjob_pod_belongs_to_the_trainjob_not_to_its_jobset():
    adapter, group = adapter_for(stamped(trainjob_pod(1)))
    assert adapter is TRAINJOB and (group.kind, group.name, group.uid) == ("TrainJob", "llama", TRAINJOB_UID)
    assert (group.api_version, group.plural) == ("trainer.kubeflow.org/v1alpha1", "trainjobs")
    assert group.collector_name == "TrainJob:llama"
    assert group.event_target.kind == "TrainJob" and group.event_target.uid == TRAINJOB_UID, "Events on the TrainJob"
    assert adapter.restart_lever == "spec.suspend toggle; under Kueue, its JobSet's failurePolicy"
    key, value = adapter.pod_selector(group).split("=")
    assert trainjob_pod()["metadata"]["labels"][key] == value
    assert adapter.token_secret_name("llama") == "llama-rankwatch-trainjob-token"
    assert adapter.token_secret_name("llama") != JOBSET.token_secret_name("llama"), "never its JobSet's"


def test_its_index_is_the_completion_index_torchrun_gets_as_pet_node_rank():
    pod = stamped(trainjob_pod(3))
    assert TRAINJOB.index_of(pod) == 3
    [rank_env] = [e for e in pod["spec"]["containers"][0]["env"] if e["name"] == "PET_NODE_RANK"]
    assert rank_env["valueFrom"]["fieldRef"]["fieldPath"] == TRAINJOB.index_field().path


def test_the_group_size_is_the_trainjobs_num_nodes_and_nothing_else():
    assert TRAINJOB.expected_size({"spec": {"trainer": {"numNodes": 16}}}) == 16
    for hostile in ({}, {"spec": None}, {"spec": {"trainer": None}}, {"spec": {"trainer": {"numNodes": "16"}}},
                    {"spec": {"trainer": {"numNodes": True}}}, {"spec": {"trainer": {"numNodes": -2}}},
                    {"spec": {"trainer": {"numNodes": 0}}}, {"spec": {"trainer": {"numNodes": 2.5}}}):  # fmt: skip
        assert TRAINJOB.expected_size(hostile) is None, hostile


def test_a_trainjob_without_num_nodes_takes_its_runtimes_as_the_trainer_does():
    assert runtime_nodes({"spec": {"mlPolicy": {"numNodes": 4, "torch": {}}}}) == 4
    assert runtime_nodes({"spec": {"mlPolicy": {"torch": {}}}}) == 1, "the mlPolicy's default"
    for hostile in ({}, {"spec": None}, {"spec": {"mlPolicy": None}}, {"spec": {"mlPolicy": {"numNodes": "4"}}},
                    {"spec": {"mlPolicy": {"numNodes": True}}}, {"spec": {"mlPolicy": {"numNodes": 0}}},
                    [], "x"):  # fmt: skip
        assert runtime_nodes(hostile) is None, hostile
    assert group_size(None, TRAINJOB, {"spec": {"trainer": {"numNodes": 16}}}) == 16, "its own: no API call"
    assert group_size(None, JOBSET, {"spec": {"replicatedJobs": [{"replicas": 2}]}}) == 2


def test_a_runtime_ref_that_is_not_the_trainers_is_not_read():
    for ref in ({"name": "r", "apiGroup": "example.com"}, {"name": "r", "kind": "ConfigMap"}, {"name": ""}, {}):
        trainjob = {
            "metadata": {"name": "llama", "namespace": "team-a", "uid": TRAINJOB_UID},
            "spec": {"runtimeRef": ref},
        }
        assert group_size(None, TRAINJOB, trainjob) is None, ref  # kube=None: any API call would fail


def test_bad_or_missing_labels_name_no_trainjob_and_never_crash():
    plain = trainjob_pod()
    assert adapter_for(plain)[0] is JOBSET, "without the webhook's uid: a plain JobSet's pod"
    for value in ("", None, 7, ["uid"]):
        pod = trainjob_pod()
        pod["metadata"]["annotations"][TRAINJOB_UID_ANNOTATION] = value
        assert TRAINJOB.group_of(pod) is None, value
    orphan = stamped(trainjob_pod())
    orphan["metadata"]["ownerReferences"] = []
    assert TRAINJOB.group_of(orphan) is None, "a pod no Job controls is no TrainJob's, whatever it says"
    unnamed = stamped(trainjob_pod())
    unnamed["metadata"]["labels"].pop("jobset.sigs.k8s.io/jobset-name")
    assert TRAINJOB.group_of(unnamed) is None
    for index in ("x", "-1", "", "1e3"):
        pod = stamped(trainjob_pod())
        pod["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] = index
        assert TRAINJOB.index_of(pod) is None, index
    assert TRAINJOB.group_of({}) is None and TRAINJOB.group_of({"metadata": {"labels": None}}) is None


def run_webhook(pod: dict[str, Any], kube: Any = None, **trainjob_of_jobset: str) -> dict[str, Any]:
    """The admission handler as kopf calls it (a dry run), with what this process already learnt of the
    JobSets' owners (JobSet uid -> TrainJob uid, "" for none); the pod after its patch."""
    body = kopf.Body(copy.deepcopy(pod))
    patch = kopf.Patch(body=body)
    owners = webhook.TrainJobOfJobSet()
    for jobset_uid, trainjob_uid in trainjob_of_jobset.items():
        owners.add(jobset_uid, trainjob_uid)
    memo = kopf.Memo(config=type("Config", (), {"pods": CONFIG})(), kube=kube, trainjob_of_jobset=owners)
    asyncio.run(webhook.inject_pod(body=body, patch=patch, dryrun=True, memo=memo))
    return jsonpatch.apply_patch(pod, patch.as_json_patch())


def env_of(container: dict) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container.get("env", [])}


def test_the_webhook_writes_the_trainjobs_uid_and_injects_the_pod_as_the_trainjobs():
    after = run_webhook(trainjob_pod(1), **{JOBSET_UID: TRAINJOB_UID})
    assert after["metadata"]["annotations"][TRAINJOB_UID_ANNOTATION] == TRAINJOB_UID
    assert after["metadata"]["annotations"]["rankwatch.io/tracing"] == "enabled"
    sidecar = env_of(after["spec"]["initContainers"][1])
    assert sidecar["RANKWATCH_JOB_NAME"] == "TrainJob:llama"
    volumes = {v["name"]: v for v in after["spec"]["volumes"]}
    assert volumes["rankwatch-token"]["secret"]["secretName"] == "llama-rankwatch-trainjob-token"
    assert adapter_for(after)[0] is TRAINJOB


def test_a_uid_the_pods_creator_wrote_is_replaced_or_removed_never_believed():
    forged = trainjob_pod()
    forged["metadata"]["annotations"][TRAINJOB_UID_ANNOTATION] = "someone-elses-trainjob"
    after = run_webhook(forged, **{JOBSET_UID: TRAINJOB_UID})
    assert after["metadata"]["annotations"][TRAINJOB_UID_ANNOTATION] == TRAINJOB_UID
    after = run_webhook(forged, **{JOBSET_UID: ""})  # a plain JobSet: no TrainJob controls it
    assert TRAINJOB_UID_ANNOTATION not in after["metadata"]["annotations"]
    assert env_of(after["spec"]["initContainers"][1])["RANKWATCH_JOB_NAME"] == "JobSet:llama"


def test_a_jobset_the_webhook_cannot_read_leaves_the_pod_admitted_unchanged_with_the_reason():
    configuration = kubernetes.client.Configuration()
    configuration.host = "http://127.0.0.1:9"  # discard: nothing listens; the read is refused at once
    configuration.retries = False
    pod = trainjob_pod()
    after = run_webhook(pod, kube=kubernetes.client.ApiClient(configuration))
    assert after["spec"] == pod["spec"], "admitted unchanged"
    assert after["metadata"]["annotations"]["rankwatch.io/not-injected"].startswith(
        "could not read the JobSet this pod belongs to"
    )


def test_pods_that_are_not_a_jobsets_cost_the_webhook_no_api_call():
    pod = trainjob_pod()
    for key in ("jobset.sigs.k8s.io/jobset-name", "jobset.sigs.k8s.io/jobset-uid"):
        pod["metadata"]["labels"].pop(key)
    after = run_webhook(pod)  # kube=None: any API call would fail the injection
    assert env_of(after["spec"]["initContainers"][1])["RANKWATCH_JOB_NAME"] == "Job:llama-node-0"


def test_owners_of_jobsets_are_remembered_within_a_bound():
    owners = webhook.TrainJobOfJobSet(size=2)
    for jobset_uid in ("a", "b", "a", "c"):
        owners.add(jobset_uid, f"tj-{jobset_uid}")
    assert "a" in owners and "c" in owners and "b" not in owners and owners.get("a") == "tj-a"


def test_rankwatch_describe_takes_trainjob():
    assert kind_named("trainjob").api_version == kind_named("TrainJobs").api_version == "trainer.kubeflow.org/v1alpha1"
    assert kind_named("tj").kind == "TrainingJob", "tj stays the TrainingJob's short name"


def test_the_injected_index_is_the_completion_index():
    after = run_webhook(trainjob_pod(1), **{JOBSET_UID: TRAINJOB_UID})
    sidecar = env_of(after["spec"]["initContainers"][1])
    assert sidecar["RANKWATCH_REPLICA_INDEX"] == {"fieldRef": {"fieldPath": TRAINJOB.index_field().path}}
    assert after["spec"]["initContainers"][0]["name"] == pod_spec.INIT_CONTAINER
