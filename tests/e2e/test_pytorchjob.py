"""PyTorchJobs run by the real Kubeflow training-operator v1 (its PyTorchJob controller, built from its Go
module): the training-operator makes the Master and Worker pods, with torchrun's node rank in their env;
rankwatch's webhook injects them, the operator (as the chart's ServiceAccount) diagnoses, cordons, alerts
and writes on the PyTorchJob itself."""

from __future__ import annotations

import re
from typing import Any

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException
from other_kinds import (
    GROUP_ANNOTATIONS,
    PATIENCE_S,
    STRAGGLER,
    assert_hang_handled,
    assert_no_refused_call,
    assert_straggler_handled,
    describe_cli,
    diagnosis_on,
    injected,
    owner_events,
    standin_trainer,
    start_operator,
    stop,
)

pytestmark = pytest.mark.e2e

PYTORCHJOB_API = ("kubeflow.org", "v1", "pytorchjobs")


@pytest.fixture
def training_operator(kubeconfig, unwatched_namespace, tmp_path):
    """The real training-operator (PyTorchJob only), its webhook for this test's namespace."""
    from rankwatch.cluster.training_operator import TrainingOperatorController

    controller = TrainingOperatorController(kubeconfig, unwatched_namespace, tmp_path / "training-operator")
    controller.start(PATIENCE_S)
    yield controller
    controller.stop()


def standin_pytorchjob(name: str, faults: dict[str, str]) -> dict[str, Any]:
    """A PyTorchJob of a Master and one Worker, 4 ranks each, opted in by its pod templates, as a user
    writes it: the stand-in trainer takes its node rank and world size from what the training-operator
    sets (PET_NODE_RANK, PET_NPROC_PER_NODE, WORLD_SIZE), as torchrun does."""
    trainer = standin_trainer(faults, 8)
    trainer["name"] = "pytorch"  # the container the training-operator sets torchrun's env in
    trainer["env"] = [e for e in trainer["env"] if e["name"] not in ("NODE_RANK", "NPROC_PER_NODE", "WORLD_SIZE")]
    template = {"metadata": {"annotations": dict(GROUP_ANNOTATIONS)}, "spec": {"containers": [trainer]}}
    replica = {"replicas": 1, "restartPolicy": "Never", "template": template}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        "spec": {"nprocPerNode": "4", "pytorchReplicaSpecs": {"Master": replica, "Worker": replica}},
    }


def create_pytorchjob(api, namespace: str, name: str, faults: dict[str, str]) -> str:
    created = kubernetes.client.CustomObjectsApi(api).create_namespaced_custom_object(
        *PYTORCHJOB_API[:2], namespace, PYTORCHJOB_API[2], standin_pytorchjob(name, faults)
    )
    return created["metadata"]["uid"]


def read_pytorchjob(api, namespace: str, name: str) -> dict[str, Any]:
    return kubernetes.client.CustomObjectsApi(api).get_namespaced_custom_object(
        *PYTORCHJOB_API[:2], namespace, PYTORCHJOB_API[2], name
    )


def env_of(container: kubernetes.client.V1Container) -> dict[str, str]:
    return {e.name: e.value for e in container.env or []}


def test_a_straggler_in_a_pytorchjob_run_by_the_real_training_operator_is_diagnosed_cordoned_alerted_and_written_on_it(
    watching, training_operator, kubeconfig, api, unwatched_namespace, eventually, alert_sink, tmp_path
):  # fmt: skip
    namespace = unwatched_namespace
    core = kubernetes.client.CoreV1Api(api)
    invalid = standin_pytorchjob("nameless", {})
    invalid["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "trainer"
    with pytest.raises(ApiException) as refused:
        kubernetes.client.CustomObjectsApi(api).create_namespaced_custom_object(
            *PYTORCHJOB_API[:2], namespace, PYTORCHJOB_API[2], invalid, dry_run="All"
        )
    assert "must have at least one container with name pytorch" in refused.value.body, "its own webhook answers"
    with watching("slowtorch"):
        uid = create_pytorchjob(api, namespace, "slowtorch", STRAGGLER)
        selector = "training.kubeflow.org/job-name=slowtorch"
        pods = eventually(
            lambda: len(p := core.list_namespaced_pod(namespace, label_selector=selector).items) == 2 and p,
            PATIENCE_S,
            what="the PyTorchJob's Master and Worker pods, made by the training-operator",
        )  # fmt: skip
        assert all(injected(pod) for pod in pods), "the webhook injects a PyTorchJob's pods"
        by_name = {pod.metadata.name: pod for pod in pods}
        assert sorted(by_name) == ["slowtorch-master-0", "slowtorch-worker-0"]
        for pod in pods:
            [owner] = pod.metadata.owner_references
            assert (owner.kind, owner.uid, owner.controller) == ("PyTorchJob", uid, True)
            sidecar = env_of(next(c for c in pod.spec.init_containers if c.name == "rankwatch-sidecar"))
            trainer = env_of(next(c for c in pod.spec.containers if c.name == "pytorch"))
            assert sidecar["RANKWATCH_JOB_NAME"] == "PyTorchJob:slowtorch"
            assert sidecar["RANKWATCH_REPLICA_INDEX"] == trainer["PET_NODE_RANK"], "the node rank torchrun gets"
        assert env_of(by_name["slowtorch-worker-0"].spec.containers[0])["PET_NODE_RANK"] == "1"
        token = core.read_namespaced_secret("slowtorch-rankwatch-pytorchjob-token", namespace)
        assert [o.uid for o in token.metadata.owner_references] == [uid]

        node = assert_straggler_handled(
            api, namespace, lambda: read_pytorchjob(api, namespace, "slowtorch"), "PyTorchJob", "slowtorch", uid,
            alert_sink, eventually,
        )  # fmt: skip
        assert by_name["slowtorch-worker-0"].spec.node_name == node, "rank 5 is the Worker's (node rank 1)"
        described = describe_cli(kubeconfig, namespace, "pytorchjob/slowtorch")
        assert "Kind:         PyTorchJob (kubeflow.org/v1)" in described, described
        assert "Health:       Degraded" in described and f"  Nodes:       {node}" in described
        assert re.search(r"Warning\s+Straggler\s+\S+\s+rankwatch-operator\s+rank 5", described), described
    assert_no_refused_call(tmp_path / "operator.log")


def test_a_rank_that_never_calls_hangs_a_pytorchjob_and_is_named_on_it_without_a_restart(
    watching, training_operator, api, unwatched_namespace, eventually, alert_sink, tmp_path
):  # fmt: skip
    namespace = unwatched_namespace
    core = kubernetes.client.CoreV1Api(api)
    hang = {"RANKWATCH_STANDIN_FAULT_RANK": "2", "RANKWATCH_STANDIN_HANG_BEFORE_CALL": "300"}
    with watching("stucktorch"):
        uid = create_pytorchjob(api, namespace, "stucktorch", hang)

        def read() -> dict[str, Any]:
            return read_pytorchjob(api, namespace, "stucktorch")

        node = assert_hang_handled(api, namespace, read, "PyTorchJob", "stucktorch", uid, alert_sink, eventually)
        assert core.read_namespaced_pod("stucktorch-master-0", namespace).spec.node_name == node, "rank 2: the Master"
        outcome = eventually(
            lambda: diagnosis_on(read()["metadata"].get("annotations")).get("restart"), PATIENCE_S,
            what="the restart looked at",
        )  # fmt: skip
        assert outcome == "not restarted: PyTorchJob has no restart lever rankwatch pulls; cordon and page only"
        [skipped] = owner_events(api, namespace, uid, "RestartSkipped")
        assert skipped.type == "Normal" and "no restart lever" in skipped.message
    assert_no_refused_call(tmp_path / "operator.log")


def test_pytorchjob_pods_made_while_the_operator_is_down_start_and_are_reported_on_the_pytorchjob(
    webhook, chart_rbac_kubeconfig, training_operator, processes, api, unwatched_namespace, eventually, tmp_path
):  # fmt: skip
    port, certs = webhook
    namespace = unwatched_namespace
    core = kubernetes.client.CoreV1Api(api)
    # No operator: the API server gets no answer from the webhook and, failing open, admits the pods.
    uid = create_pytorchjob(api, namespace, "unseen", {})
    selector = "training.kubeflow.org/job-name=unseen"
    pods = eventually(
        lambda: len(p := core.list_namespaced_pod(namespace, label_selector=selector).items) == 2 and p,
        PATIENCE_S,
        what="the PyTorchJob's pods, with no webhook answering",
    )  # fmt: skip
    assert not any(injected(pod) for pod in pods)
    operator = start_operator(
        processes, chart_rbac_kubeconfig, namespace, tmp_path / "operator.log", port, certs, processes.free_port()
    )
    try:

        def reported() -> list[Any]:
            return [e for e in owner_events(api, namespace, uid, "Unwatched") if "unseen-worker-0" in e.message]

        [event] = eventually(reported, PATIENCE_S, what="the Unwatched Event on the PyTorchJob")
        assert event.type == "Warning" and event.involved_object.kind == "PyTorchJob"
        assert event.message.startswith("2 of 2 opted-in pod(s)") and "unseen-master-0" in event.message
        annotations = read_pytorchjob(api, namespace, "unseen")["metadata"]["annotations"]
        assert annotations["rankwatch.io/unwatched-pods"] == "2"
    finally:
        stop(operator)
    assert_no_refused_call(tmp_path / "operator.log")
