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
    HANG_IN_FIRST_ATTEMPT,
    PATIENCE_S,
    assert_no_refused_call,
    assert_straggler_handled,
    describe_cli,
    injected,
    owner_events,
    second_look,
    settled_restart,
    standin_trainer,
    start_operator,
    stop,
)
from trainingjobs import STRAGGLER

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


def test_a_hang_in_a_pytorchjob_is_named_on_it_and_restarts_it_through_suspend_away_from_the_node(
    watching, training_operator, kubeconfig, api, unwatched_namespace, eventually, alert_sink, tmp_path
):  # fmt: skip
    """Rank 2 (the Master's) never calls in the first attempt: the PyTorchJob carries the Hang, its node is
    cordoned, and the real training-operator, suspended and resumed, makes every pod again elsewhere."""
    from rankwatch.operator.kinds.adapter import Group

    namespace = unwatched_namespace
    core = kubernetes.client.CoreV1Api(api)
    with watching("stucktorch"):
        uid = create_pytorchjob(api, namespace, "stucktorch", HANG_IN_FIRST_ATTEMPT)

        def read() -> dict[str, Any]:
            return read_pytorchjob(api, namespace, "stucktorch")

        def pods() -> list[Any]:
            return core.list_namespaced_pod(namespace, label_selector="training.kubeflow.org/job-name=stucktorch").items

        first = {pod.metadata.uid for pod in eventually(lambda: len(pods()) == 2 and pods(), PATIENCE_S, what="pods")}
        record = eventually(lambda: settled_restart(read), PATIENCE_S, interval=1, what="the PyTorchJob's restart")
        assert record["kind"] == "Hang" and record["ranks"] == [2], record
        [node] = record["nodes"]
        assert record["remediation"] == f"cordoned and tainted {node}" and record["alertedTime"]
        assert record["restart"].startswith("suspended the PyTorchJob"), record
        assert "restart 1 of at most 3" in record["restart"]
        alerts = eventually(
            lambda: alert_sink.alerts(jobkind="PyTorchJob", trainingjob="stucktorch", alertname="TrainingJobHang"),
            PATIENCE_S,
            what="the hang's alert",
        )  # fmt: skip
        assert [a["labels"]["node"] for a in alerts if a["status"] == "firing"] == [node]
        events = core.list_namespaced_event(namespace, field_selector="reason=Hang").items
        assert [e.involved_object.kind for e in events if e.involved_object.uid == uid] == ["PyTorchJob"]

        def resumed_pods() -> list[Any]:
            job = read()
            if (job["spec"].get("runPolicy") or {}).get("suspend") or "rankwatch.io/restart-suspended" in (
                job["metadata"].get("annotations") or {}
            ):
                return []
            now = [p for p in pods() if p.metadata.uid not in first and not p.metadata.deletion_timestamp]
            return len(now) == 2 and all(p.status.phase == "Running" for p in now) and now

        restarted = eventually(resumed_pods, PATIENCE_S, what="the PyTorchJob resumed, its 2 pods made again")
        assert sorted(p.metadata.name for p in restarted) == ["stucktorch-master-0", "stucktorch-worker-0"]
        assert node not in {pod.spec.node_name for pod in restarted}, "a restarted pod landed on the cordoned node"
        assert not {pod.metadata.uid for pod in pods()} & first, "every pod of the hung attempt ended"
        conditions = {c["type"]: c["status"] for c in read()["status"].get("conditions") or []}
        assert conditions.get("Failed") != "True", conditions
        [event] = eventually(lambda: owner_events(api, namespace, uid, "Restarting"), PATIENCE_S, what="Restarting")
        assert event.involved_object.kind == "PyTorchJob"

        eventually(lambda: read()["metadata"]["annotations"].get("rankwatch.io/health") == "Healthy", PATIENCE_S,
                   what="the restarted PyTorchJob watched again, healthy")  # fmt: skip
        described = describe_cli(kubeconfig, namespace, "pytorchjob/stucktorch")
        assert f"  Restart:     {record['restart']}" in described and "  Active:      false" in described

        second_look(api, Group("kubeflow.org/v1", "PyTorchJob", "pytorchjobs", namespace, "stucktorch", uid), read)
        assert read()["metadata"]["annotations"]["rankwatch.io/restarts"] == "1"
        assert not (read()["spec"].get("runPolicy") or {}).get("suspend")
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


def test_a_pytorchjob_rankwatch_left_suspended_is_resumed_by_the_next_operator_and_no_other(
    watching, training_operator, api, unwatched_namespace, eventually, alert_sink
):  # fmt: skip
    """An operator that stopped between suspending a PyTorchJob and resuming it: the next one resumes it
    (the mark on the job says so) and the training-operator makes its pods; one its user suspended stays."""
    namespace = unwatched_namespace
    objects = kubernetes.client.CustomObjectsApi(api)
    for name, marks in (("left", {"rankwatch.io/restart-suspended": "2026-11-28T18:00:00Z"}), ("held", {})):
        manifest = standin_pytorchjob(name, {})
        manifest["metadata"]["annotations"] = marks
        manifest["spec"]["runPolicy"] = {"suspend": True}
        objects.create_namespaced_custom_object(*PYTORCHJOB_API[:2], namespace, PYTORCHJOB_API[2], manifest)
    with watching("left"):

        def resumed() -> bool:
            job = read_pytorchjob(api, namespace, "left")
            annotations = job["metadata"].get("annotations") or {}
            return not job["spec"]["runPolicy"].get("suspend") and "rankwatch.io/restart-suspended" not in annotations

        eventually(resumed, PATIENCE_S, what="the PyTorchJob rankwatch suspended resumed")
        core = kubernetes.client.CoreV1Api(api)
        eventually(
            lambda: len(core.list_namespaced_pod(namespace, label_selector="training.kubeflow.org/job-name=left").items)
            == 2,
            PATIENCE_S,
            what="its pods made by the training-operator",
        )  # fmt: skip
        assert read_pytorchjob(api, namespace, "held")["spec"]["runPolicy"]["suspend"], "the user's suspend"
