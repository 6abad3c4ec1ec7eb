"""Pods of other kinds: which the webhook injects, and the pod spec after its mutation (the same
injection a TrainingJob's pods get, with the group's identity from the pod)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import jsonpatch
import kopf
import pytest

from rankwatch.operator.config import WorkerPodSettings
from rankwatch.operator.kinds import injection, webhook
from rankwatch.operator.kinds.group_settings import group_settings
from rankwatch.operator.lifecycle import pod_spec
from rankwatch.operator.spec import TrainingJobSpec

CONFIG = WorkerPodSettings(image="registry.example/rankwatch:test", collector_url="http://collector:8080")
JOB_UID = "9d3c-job-uid"


def indexed_job_pod(index: int = 2, **annotations: str) -> dict[str, Any]:
    """A pod as the Job controller creates it for an Indexed Job whose template opted in."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": f"bert-{index}-",
            "namespace": "team-b",
            "labels": {
                "batch.kubernetes.io/controller-uid": JOB_UID,
                "batch.kubernetes.io/job-name": "bert",
                "batch.kubernetes.io/job-completion-index": str(index),
            },
            "annotations": {
                "batch.kubernetes.io/job-completion-index": str(index),
                "rankwatch.io/inject": "true",
                **annotations,
            },
            "ownerReferences": [
                {"apiVersion": "batch/v1", "kind": "Job", "name": "bert", "uid": JOB_UID, "controller": True}
            ],
        },
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "trainer",
                    "image": "pytorch:latest",
                    "command": ["torchrun", "--nproc-per-node=4", "train.py"],
                    "env": [
                        {"name": "JOB_COMPLETION_INDEX", "value": str(index)},
                        {"name": "NCCL_DEBUG", "value": "WARN"},
                    ],
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                }
            ],
            "volumes": [{"name": "data", "emptyDir": {}}],
        },
    }


def env_of(container: dict) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container.get("env", [])}


def injected(pod: dict[str, Any]) -> dict[str, Any]:
    decision = injection.plan(pod)
    assert isinstance(decision, injection.Injection), decision
    return injection.injected_pod(pod, decision, CONFIG)


def test_an_opted_in_indexed_job_pod_gets_the_library_the_sidecar_and_its_identity():
    pod = injected(indexed_job_pod(2, **{"rankwatch.io/nproc-per-node": "4"}))
    spec = pod["spec"]
    init, sidecar = spec["initContainers"]
    assert init["command"] == ["cp", "/opt/rankwatch/lib/librankwatch-nccl.so", "/rankwatch/lib/librankwatch-nccl.so"]
    assert sidecar["name"] == "rankwatch-sidecar" and sidecar["restartPolicy"] == "Always"
    sidecar_env = env_of(sidecar)
    assert sidecar_env["RANKWATCH_JOB_NAME"] == "Job:bert" and sidecar_env["RANKWATCH_JOB_NAMESPACE"] == "team-b"
    # The index is known only once the pod exists: the kubelet reads it from the Job's annotation.
    assert sidecar_env["RANKWATCH_REPLICA_INDEX"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
    }
    assert sidecar_env["RANKWATCH_NPROC_PER_NODE"] == "4"
    assert sidecar_env["RANKWATCH_COLLECTOR_URL"] == "http://collector:8080"
    # Its only rankwatch label, for the chart's NetworkPolicies (no job-name: it is not a TrainingJob's pod).
    assert {k: v for k, v in pod["metadata"]["labels"].items() if k.startswith("rankwatch.io/")} == {
        "rankwatch.io/traced": "true"
    }

    trainer = spec["containers"][0]
    env = env_of(trainer)
    assert env["LD_PRELOAD"] == "/rankwatch/lib/librankwatch-nccl.so"
    assert env["RANKWATCH_JOB_NAME"] == "Job:bert" and env["RANKWATCH_TRACE_DIR"] == "/rankwatch/traces"
    assert env["NCCL_DEBUG"] == "WARN" and env["JOB_COMPLETION_INDEX"] == "2", "the pod's own env is kept"
    assert "RANK" not in env and "WORLD_SIZE" not in env, "ranks come from torchrun at run time"
    assert {m["name"] for m in trainer["volumeMounts"]} == {"data", "rankwatch-lib", "rankwatch-traces"}

    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["rankwatch-token"]["secret"] == {
        "secretName": "bert-rankwatch-job-token",
        "defaultMode": pod_spec.TOKEN_FILE_MODE,
        "optional": True,  # made at admission; a pod never waits for it
    }
    assert spec["shareProcessNamespace"] is True
    assert pod["metadata"]["annotations"]["rankwatch.io/tracing"] == "enabled"
    assert spec["restartPolicy"] == "Never" and "hostname" not in spec, "nothing of a TrainingJob's rendezvous"


def test_the_webhook_injects_exactly_what_a_trainingjob_pod_gets():
    """One injection for both: the same init container, sidecar (but for the group's identity), volumes
    and trainer env."""
    template = {"spec": copy.deepcopy(indexed_job_pod(0)["spec"])}
    job = {"metadata": {"name": "bert", "namespace": "team-b", "uid": "u"}}
    worker = pod_spec.worker_pod(job, TrainingJobSpec(template=template, nprocPerNode=4), 0, CONFIG)
    pod = injected(indexed_job_pod(0, **{"rankwatch.io/nproc-per-node": "4"}))
    assert pod["spec"]["initContainers"][0] == worker["spec"]["initContainers"][0]
    identity = {"RANKWATCH_REPLICA_INDEX", "RANKWATCH_JOB_NAME"}  # the group's collector name: Job:bert
    ours, theirs = pod["spec"]["initContainers"][1], worker["spec"]["initContainers"][1]
    assert {k: v for k, v in env_of(ours).items() if k not in identity} == {
        k: v for k, v in env_of(theirs).items() if k not in identity
    }
    assert {k: v for k, v in ours.items() if k != "env"} == {k: v for k, v in theirs.items() if k != "env"}
    token = {"rankwatch-token"}
    assert [v for v in pod["spec"]["volumes"] if v["name"] not in token] == [
        v for v in worker["spec"]["volumes"] if v["name"] not in token
    ]
    rendezvous = set(pod_spec.RENDEZVOUS_ENV)
    assert {k: v for k, v in env_of(pod["spec"]["containers"][0]).items() if k not in identity} == {
        k: v for k, v in env_of(worker["spec"]["containers"][0]).items() if k not in rendezvous | identity
    }


@pytest.mark.parametrize(
    ("change", "reason", "asked"),
    [
        (lambda pod: pod["metadata"]["annotations"].pop("rankwatch.io/inject"), "not opted in", False),
        (lambda pod: pod["metadata"]["annotations"].update({"rankwatch.io/opt-out": "true"}), "not opted in", False),
        (lambda pod: pod["metadata"]["annotations"].update({"rankwatch.io/tracing": "enabled"}), "already", False),
        (lambda pod: pod["metadata"]["labels"].update({"rankwatch.io/job-name": "x"}), "a TrainingJob's pod", False),
        # Labelled as a JobSet's without its uid: not the Indexed Job's (a JobSet's child), nor a JobSet's.
        (lambda pod: pod["metadata"]["labels"].update({"jobset.sigs.k8s.io/jobset-name": "js"}), "no kind", True),
        # Not Indexed: no place in a group.
        (lambda pod: pod["metadata"]["annotations"].pop("batch.kubernetes.io/job-completion-index"), "no kind", True),
        (lambda pod: pod["metadata"].update({"ownerReferences": []}), "owners: none", True),
        (
            lambda pod: pod["metadata"]["annotations"].update({"rankwatch.io/nproc-per-node": "-4"}),
            "is not a whole number from 1",
            True,
        ),
        (
            lambda pod: pod["metadata"]["annotations"].update({"rankwatch.io/sensitivity-seconds": "1e9"}),
            "annotation rankwatch.io/sensitivity-seconds='1e9' is not a whole number from 1 to 86400",
            True,
        ),
        (
            lambda pod: pod["metadata"]["annotations"].update({"rankwatch.io/remediation": "reboot"}),
            "rankwatch.io/remediation='reboot' is not one of cordon, dry-run, off",
            True,
        ),
    ],
)
def test_pods_the_webhook_leaves_alone_and_why(change, reason, asked):
    pod = indexed_job_pod()
    change(pod)
    decision = injection.plan(pod)
    assert isinstance(decision, injection.NotInjected)
    assert reason in decision.reason and decision.asked is asked


def test_a_groups_annotations_set_its_window_sensitivity_layout_and_remediation():
    pod = indexed_job_pod(
        1,
        **{
            "rankwatch.io/nproc-per-node": "4",
            "rankwatch.io/sensitivity-seconds": "30",
            "rankwatch.io/window-seconds": "2",
            "rankwatch.io/tensor-parallel": "4",
            "rankwatch.io/remediation": "dry-run",
        },
    )
    sidecar = env_of(injected(pod)["spec"]["initContainers"][1])
    assert sidecar["RANKWATCH_SENSITIVITY_SECONDS"] == "30" and sidecar["RANKWATCH_WINDOW_SECONDS"] == "2"
    settings = group_settings(pod, "Job team-b/bert")
    spec = settings.spec(replicas=3)
    assert (spec.world_size, spec.parallelism.tensor, spec.data_parallel) == (12, 4, 3)
    assert spec.remediation.dryRun and spec.remediation.cordon


def test_the_indexed_job_adapter_finds_the_group_its_size_and_each_pods_place():
    from rankwatch.operator.kinds.indexed_job import INDEXED_JOB
    from rankwatch.operator.kinds.registry import adapter_for

    pod = indexed_job_pod(3)
    adapter, group = adapter_for(pod)
    assert adapter is INDEXED_JOB and adapter.restart_lever == "spec.suspend toggle"
    assert (group.kind, group.namespace, group.name, group.uid) == ("Job", "team-b", "bert", JOB_UID)
    assert str(group) == "Job team-b/bert"
    assert adapter.index_of(pod) == 3
    key, value = adapter.pod_selector(group).split("=")
    assert pod["metadata"]["labels"][key] == value, "the selector finds exactly the group's pods"
    assert adapter.expected_size({"spec": {"completions": 4, "parallelism": 4}}) == 4
    assert adapter.expected_size({"spec": {}}) is None
    assert group.event_target.kind == "Job" and group.event_target.uid == JOB_UID
    assert adapter.token_secret_name(group.name) != "bert-rankwatch-token", "never a TrainingJob's of the same name"
    pod["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] = "x"
    assert adapter.index_of(pod) is None


def run_webhook(pod: dict[str, Any]) -> dict[str, Any]:
    """The admission handler as kopf calls it (a dry run: no token Secret made); the pod after its patch."""
    body = kopf.Body(copy.deepcopy(pod))
    patch = kopf.Patch(body=body)
    memo = kopf.Memo(config=type("Config", (), {"pods": CONFIG})(), kube=None)
    asyncio.run(webhook.inject_pod(body=body, patch=patch, dryrun=True, memo=memo))
    return jsonpatch.apply_patch(pod, patch.as_json_patch())


def test_the_webhook_patch_turns_the_admitted_pod_into_the_injected_one():
    pod = indexed_job_pod(1)
    assert run_webhook(pod) == injected(pod)


def test_a_pod_the_webhook_cannot_inject_is_admitted_with_the_reason():
    pod = indexed_job_pod()
    pod["spec"]["containers"][0]["name"] = "rankwatch-sidecar"
    after = run_webhook(pod)
    assert after["spec"] == pod["spec"], "admitted unchanged"
    why = after["metadata"]["annotations"]["rankwatch.io/not-injected"]
    assert why == "Job team-b/bert: container name 'rankwatch-sidecar' is reserved for rankwatch"
    untouched = indexed_job_pod()
    untouched["metadata"]["annotations"].pop("rankwatch.io/inject")
    assert run_webhook(untouched) == untouched


def test_groups_with_a_token_are_remembered_within_a_bound():
    known = webhook.GroupsWithToken(size=2)
    for uid in ("a", "b", "a", "c"):
        known.add(uid)
    assert "a" in known and "c" in known and "b" not in known, "the least recently made goes first"


JOBSET_UID = "5e1f-jobset-uid"


def jobset_pod(job_index: int = 1, completion_index: int = 0) -> dict[str, Any]:
    """A pod as the Job controller creates it for a JobSet's child Job (labels as JobSet v0.12 sets them)."""
    pod = indexed_job_pod(completion_index)
    child = f"llm-workers-{job_index}"
    pod["metadata"]["labels"].update(
        {
            "batch.kubernetes.io/job-name": child,
            "jobset.sigs.k8s.io/jobset-name": "llm",
            "jobset.sigs.k8s.io/jobset-uid": JOBSET_UID,
            "jobset.sigs.k8s.io/replicatedjob-name": "workers",
            "jobset.sigs.k8s.io/job-index": str(job_index),
            "jobset.sigs.k8s.io/job-global-index": str(job_index),
        }
    )
    pod["metadata"]["ownerReferences"] = [
        {"apiVersion": "batch/v1", "kind": "Job", "name": child, "uid": f"job-{job_index}", "controller": True}
    ]
    return pod


def test_a_jobset_pod_belongs_to_the_jobset_not_to_its_child_job():
    from rankwatch.operator.kinds.jobset import JOBSET
    from rankwatch.operator.kinds.registry import adapter_for

    adapter, group = adapter_for(jobset_pod(job_index=1))
    assert adapter is JOBSET and (group.kind, group.name, group.uid) == ("JobSet", "llm", JOBSET_UID)
    assert group.api_version == "jobset.x-k8s.io/v1alpha2" and group.plural == "jobsets"
    assert adapter.restart_lever == "failurePolicy (a failed child Job)", "the JobSet's own lever"
    key, value = adapter.pod_selector(group).split("=")
    assert jobset_pod()["metadata"]["labels"][key] == value
    owner = {
        "spec": {
            "replicatedJobs": [
                {"name": "driver", "replicas": 1, "template": {"spec": {}}},
                {"name": "workers", "replicas": 2, "template": {"spec": {"parallelism": 4, "completions": 4}}},
            ]
        }
    }
    assert adapter.expected_size(owner) == 9
    assert adapter.expected_size({"spec": {"replicatedJobs": [{"replicas": "two"}]}}) is None
    assert adapter.token_secret_name("llm") not in ("llm-rankwatch-token", "llm-rankwatch-job-token")

    pod = injected(jobset_pod())
    sidecar = env_of(pod["spec"]["initContainers"][1])
    assert sidecar["RANKWATCH_JOB_NAME"] == "JobSet:llm"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["rankwatch-token"]["secret"]["secretName"] == "llm-rankwatch-jobset-token"

    bare = jobset_pod()
    bare["metadata"]["ownerReferences"] = []
    assert adapter_for(bare) is None, "a pod no Job controls is no JobSet's, whatever its labels say"


def test_collector_names_of_groups_never_meet_a_trainingjobs():
    from rankwatch.operator import api
    from rankwatch.operator.diagnosis.ingest.collector import token_secret_of

    assert api.split_collector_name("llm") is None
    assert api.split_collector_name(api.group_collector_name("JobSet", "llm")) == ("JobSet", "llm")
    assert token_secret_of("llm") == "llm-rankwatch-token"
    assert token_secret_of("JobSet:llm") == "llm-rankwatch-jobset-token"
    assert token_secret_of("Job:llm") == "llm-rankwatch-job-token"
    assert token_secret_of("Deployment:llm") is None, "no kind rankwatch knows: no token, so 401"


VOLCANO_UID = "77aa-vcjob-uid"


def volcano_pod(task_index: int = 1) -> dict[str, Any]:
    """A pod as Volcano's job controller (v1.10, createJobPod) makes it from an opted-in task template."""
    pod = indexed_job_pod(task_index)
    pod["metadata"] = {
        "name": f"llm-worker-{task_index}",
        "namespace": "team-b",
        "labels": {
            "volcano.sh/job-name": "llm",
            "volcano.sh/task-spec": "worker",
            "volcano.sh/task-index": str(task_index),
            "volcano.sh/job-namespace": "team-b",
            "volcano.sh/queue-name": "default",
        },
        "annotations": {
            "rankwatch.io/inject": "true",
            "volcano.sh/task-index": str(task_index),
            "volcano.sh/task-spec": "worker",
            "scheduling.k8s.io/group-name": f"llm-{VOLCANO_UID}",
            "volcano.sh/job-name": "llm",
            "volcano.sh/queue-name": "default",
            "volcano.sh/job-version": "0",
            "volcano.sh/template-uid": "llm-worker",
            "volcano.sh/job-retry-count": "0",
        },
        "ownerReferences": [
            {
                "apiVersion": "batch.volcano.sh/v1alpha1",
                "kind": "Job",
                "name": "llm",
                "uid": VOLCANO_UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }
    return pod


def test_a_volcano_job_pod_belongs_to_its_volcano_job_named_apart_from_a_batch_job():
    from rankwatch.operator.kinds.registry import adapter_for
    from rankwatch.operator.kinds.volcano_job import VOLCANO_JOB

    pod = volcano_pod(1)
    adapter, group = adapter_for(pod)
    assert adapter is VOLCANO_JOB and (group.kind, group.kind_key, group.uid) == ("Job", "VolcanoJob", VOLCANO_UID)
    assert group.event_target.api_version == "batch.volcano.sh/v1alpha1", "Events go on the Volcano Job itself"
    assert str(group) == "VolcanoJob team-b/llm" and adapter.index_of(pod) == 1
    owner = {"spec": {"tasks": [{"name": "master", "replicas": 1}, {"name": "worker", "replicas": 3}]}}
    assert adapter.expected_size(owner) == 4 and adapter.expected_size({"spec": {"tasks": [{"replicas": -1}]}}) is None
    key, value = adapter.pod_selector(group).split("=")
    assert pod["metadata"]["labels"][key] == value

    sidecar = env_of(injected(pod)["spec"]["initContainers"][1])
    assert sidecar["RANKWATCH_JOB_NAME"] == "VolcanoJob:llm", "never a batch Job's (Job:llm)"
    assert sidecar["RANKWATCH_REPLICA_INDEX"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['volcano.sh/task-index']"}
    }
    assert adapter.token_secret_name("llm") == "llm-rankwatch-vcjob-token"
