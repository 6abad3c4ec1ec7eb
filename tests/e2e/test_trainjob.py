"""TrainJobs run by the real Kubeflow Trainer v2 controller (and the real JobSet controller it hands the
JobSet to), both built from their Go modules: the Trainer makes the JobSet, the JobSet controller the
Jobs, the Job controller the pods; rankwatch's webhook injects them, the operator (as the chart's
ServiceAccount) diagnoses, cordons, alerts and writes on the TrainJob itself."""

from __future__ import annotations

import re
from typing import Any

import kubernetes
import pytest
from other_kinds import (
    GROUP_ANNOTATIONS,
    HANG_IN_FIRST_ATTEMPT,
    PATIENCE_S,
    assert_hang_handled,
    assert_no_refused_call,
    assert_straggler_handled,
    describe_cli,
    injected,
    owner_events,
    resumed_pods,
    second_look,
    settled_restart,
    standin_trainer,
    start_operator,
    stop,
)
from trainingjobs import STRAGGLER

pytestmark = pytest.mark.e2e

TRAINJOB_API = ("trainer.kubeflow.org", "v1alpha1", "trainjobs")
TRAINJOB_GROUP = ("trainer.kubeflow.org/v1alpha1", "TrainJob", "trainjobs")


@pytest.fixture
def trainer_controller(kubeconfig, unwatched_namespace, jobset_controller, api, tmp_path):
    """The real Trainer controller (its webhooks for this test's namespace) and its own torch runtime, as
    a TrainingRuntime of the namespace; the JobSet controller runs beside it."""
    from rankwatch.cluster.trainer import TrainerController, torch_runtime

    controller = TrainerController(kubeconfig, unwatched_namespace, tmp_path / "trainer")
    controller.start(PATIENCE_S)
    kubernetes.client.CustomObjectsApi(api).create_namespaced_custom_object(
        "trainer.kubeflow.org", "v1alpha1", unwatched_namespace, "trainingruntimes", torch_runtime(unwatched_namespace)
    )
    yield controller
    controller.stop()


def standin_trainjob(name: str, faults: dict[str, str]) -> dict[str, Any]:
    """A TrainJob of 2 nodes on the Trainer's torch-distributed runtime, opted in by a runtime patch of
    its nodes' pod template, as a user writes it: the stand-in trainer's node rank is the completion
    index (torchrun's PET_NODE_RANK, which the Trainer sets from it)."""
    trainer = standin_trainer(faults, 8)
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name},
        "spec": {
            "runtimeRef": {"name": "torch-distributed", "kind": "TrainingRuntime"},
            "trainer": {
                "numNodes": 2,
                "image": trainer["image"],
                "command": trainer["command"],
                "env": trainer["env"],
                "resourcesPerNode": trainer["resources"],
            },
            "runtimePatches": [
                {
                    "manager": "ml.example.com/team",
                    "trainingRuntimeSpec": {
                        "template": {
                            "spec": {
                                "replicatedJobs": [
                                    {
                                        "name": "node",
                                        "template": {
                                            "spec": {"template": {"metadata": {"annotations": dict(GROUP_ANNOTATIONS)}}}
                                        },
                                    }
                                ]
                            }
                        }
                    },
                }
            ],
        },
    }


def create_trainjob(
    api, namespace: str, name: str, faults: dict[str, str], suspend: bool = False, runtime: str = "",
    labels: dict[str, str] | None = None, env: tuple[dict[str, Any], ...] = (),
    annotations: dict[str, str] | None = None,
) -> str:  # fmt: skip
    """``runtime``: run on that TrainingRuntime, the number of nodes left to it (no ``numNodes``); ``env``:
    more of the trainer's environment."""
    objects = kubernetes.client.CustomObjectsApi(api)
    trainjob = standin_trainjob(name, faults)
    trainjob["spec"]["trainer"]["env"] += list(env)
    trainjob["spec"]["suspend"] = suspend
    trainjob["metadata"]["labels"], trainjob["metadata"]["annotations"] = labels or {}, annotations or {}
    if runtime:
        trainjob["spec"]["runtimeRef"]["name"] = runtime
        del trainjob["spec"]["trainer"]["numNodes"]
    created = objects.create_namespaced_custom_object(*TRAINJOB_API[:2], namespace, TRAINJOB_API[2], trainjob)
    return created["metadata"]["uid"]


def create_runtime_of_nodes(api, namespace: str, nodes: int, failure_policy: dict[str, Any] | None = None) -> str:
    """The Trainer's torch runtime as a TrainingRuntime whose ``mlPolicy.numNodes`` is ``nodes`` (and whose
    JobSet has ``failure_policy``); its name."""
    from rankwatch.cluster.trainer import torch_runtime

    runtime = torch_runtime(namespace)
    runtime["metadata"]["name"] = f"torch-{nodes}-nodes" + ("-restartable" if failure_policy else "")
    runtime["spec"]["mlPolicy"]["numNodes"] = nodes
    if failure_policy:
        runtime["spec"]["template"]["spec"]["failurePolicy"] = failure_policy
    kubernetes.client.CustomObjectsApi(api).create_namespaced_custom_object(
        "trainer.kubeflow.org", "v1alpha1", namespace, "trainingruntimes", runtime
    )
    return runtime["metadata"]["name"]


def jobset_uid_of(api, namespace: str, name: str) -> str | None:
    try:
        found = kubernetes.client.CustomObjectsApi(api).get_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", name
        )
    except kubernetes.client.exceptions.ApiException as error:
        if error.status == 404:
            return None
        raise
    return found["metadata"]["uid"]


def mislabelled_pod(namespace: str, jobset_uid: str) -> dict[str, Any]:
    """An opted-in pod whose labels pair a JobSet's real uid with another name (no such JobSet)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "mislabelled",
            "namespace": namespace,
            "labels": {"jobset.sigs.k8s.io/jobset-name": "no-such-jobset", "jobset.sigs.k8s.io/jobset-uid": jobset_uid},
            "annotations": {"rankwatch.io/inject": "true"},
        },
        "spec": {"containers": [{"name": "c", "image": "x"}]},
    }


def read_trainjob(api, namespace: str, name: str) -> dict[str, Any]:
    return kubernetes.client.CustomObjectsApi(api).get_namespaced_custom_object(
        *TRAINJOB_API[:2], namespace, TRAINJOB_API[2], name
    )


def test_a_straggler_in_a_trainjob_run_by_the_real_trainer_is_diagnosed_cordoned_alerted_and_written_on_it(
    watching, trainer_controller, kubeconfig, api, unwatched_namespace, eventually, alert_sink, tmp_path
):  # fmt: skip
    namespace = unwatched_namespace
    core = kubernetes.client.CoreV1Api(api)
    with watching("slowtrain"):
        uid = create_trainjob(api, namespace, "slowtrain", STRAGGLER, suspend=True)
        jobset_uid = eventually(
            lambda: jobset_uid_of(api, namespace, "slowtrain"), PATIENCE_S, what="the suspended TrainJob's JobSet"
        )
        # A pod naming the JobSet's uid with another name teaches the webhook nothing about that JobSet.
        core.create_namespaced_pod(namespace, mislabelled_pod(namespace, jobset_uid), dry_run="All")
        kubernetes.client.CustomObjectsApi(api).patch_namespaced_custom_object(
            *TRAINJOB_API[:2], namespace, TRAINJOB_API[2], "slowtrain", {"spec": {"suspend": False}}
        )
        selector = "jobset.sigs.k8s.io/jobset-name=slowtrain"
        pods = eventually(
            lambda: len(p := core.list_namespaced_pod(namespace, label_selector=selector).items) == 2 and p,
            PATIENCE_S,
            what="the TrainJob's two node pods (Trainer -> JobSet -> Job -> pods)",
        )  # fmt: skip
        assert all(injected(pod) for pod in pods), "the webhook injects a TrainJob's pods"
        assert {pod.metadata.annotations["rankwatch.io/trainjob-uid"] for pod in pods} == {uid}
        sidecar = next(c for c in pods[0].spec.init_containers if c.name == "rankwatch-sidecar")
        assert {e.name: e.value for e in sidecar.env}["RANKWATCH_JOB_NAME"] == "TrainJob:slowtrain"
        token = core.read_namespaced_secret("slowtrain-rankwatch-trainjob-token", namespace)
        assert [o.uid for o in token.metadata.owner_references] == [uid]

        node = assert_straggler_handled(
            api, namespace, lambda: read_trainjob(api, namespace, "slowtrain"), "TrainJob", "slowtrain", uid,
            alert_sink, eventually,
        )  # fmt: skip
        described = describe_cli(kubeconfig, namespace, "trainjob/slowtrain")
        assert "Kind:         TrainJob (trainer.kubeflow.org/v1alpha1)" in described, described
        assert "Health:       Degraded" in described and f"  Nodes:       {node}" in described
        assert f"  Remediation: cordoned and tainted {node}" in described
        assert re.search(r"Warning\s+Straggler\s+\S+\s+rankwatch-operator\s+rank 5", described), described
        [slow_pod] = [p for p in pods if p.spec.node_name == node]
        assert slow_pod.metadata.annotations["batch.kubernetes.io/job-completion-index"] == "1", "PET_NODE_RANK 1"
        jobset = kubernetes.client.CustomObjectsApi(api).get_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", "slowtrain"
        )
        assert "rankwatch.io/diagnosis" not in (jobset["metadata"].get("annotations") or {}), "written on the TrainJob"
    assert_no_refused_call(tmp_path / "operator.log")


def test_a_rank_that_never_calls_hangs_a_trainjob_and_is_named_on_it(
    watching, trainer_controller, api, unwatched_namespace, eventually, alert_sink, tmp_path
):  # fmt: skip
    namespace = unwatched_namespace
    hang = {"RANKWATCH_STANDIN_FAULT_RANK": "2", "RANKWATCH_STANDIN_HANG_BEFORE_CALL": "300"}
    with watching("stucktrain"):
        # Queued for Kueue (whose TrainJob integration does not run here): spec.suspend is Kueue's.
        uid = create_trainjob(api, namespace, "stucktrain", hang, labels={"kueue.x-k8s.io/queue-name": "team"})

        def read() -> dict[str, Any]:
            return read_trainjob(api, namespace, "stucktrain")

        assert_hang_handled(api, namespace, read, "TrainJob", "stucktrain", uid, alert_sink, eventually)
        skipped = eventually(lambda: settled_restart(read), PATIENCE_S, what="the restart decided")
        assert skipped["restart"].startswith("not restarted: Kueue admits this TrainJob"), skipped
        assert "nor through its JobSet: the JobSet has no spec.failurePolicy" in skipped["restart"]
        assert skipped["active"] is True, "the finding stands: nothing restarted the TrainJob"
        [event] = eventually(lambda: owner_events(api, namespace, uid, "RestartSkipped"), PATIENCE_S, what="Event")
        assert event.type == "Normal" and "kueue.x-k8s.io/queue-name" in event.message
        assert not read()["spec"].get("suspend") and "rankwatch.io/restarts" not in read()["metadata"]["annotations"]
    assert_no_refused_call(tmp_path / "operator.log")


def test_a_hang_in_a_trainjob_restarts_it_through_suspend_away_from_the_node(
    watching, trainer_controller, kubeconfig, api, unwatched_namespace, eventually, alert_sink, tmp_path
):  # fmt: skip
    from rankwatch.operator.kinds.adapter import Group

    namespace = unwatched_namespace
    core = kubernetes.client.CoreV1Api(api)
    with watching("rerun-train"):
        uid = create_trainjob(api, namespace, "rerun-train", HANG_IN_FIRST_ATTEMPT)

        def read() -> dict[str, Any]:
            return read_trainjob(api, namespace, "rerun-train")

        def pods() -> list[Any]:
            selector = "jobset.sigs.k8s.io/jobset-name=rerun-train"
            return core.list_namespaced_pod(namespace, label_selector=selector).items

        first = {pod.metadata.uid for pod in eventually(lambda: len(pods()) == 2 and pods(), PATIENCE_S, what="pods")}
        record = eventually(lambda: settled_restart(read), PATIENCE_S, interval=1, what="the TrainJob's restart")
        assert record["kind"] == "Hang" and record["ranks"] == [2], record
        [node] = record["nodes"]
        assert record["remediation"] == f"cordoned and tainted {node}"
        assert record["restart"].startswith("suspended the TrainJob"), record
        assert "restart 1 of at most 3" in record["restart"] and record["active"] is False
        assert read()["metadata"]["annotations"]["rankwatch.io/restarts"] == "1"

        # The Trainer suspended its JobSet, the Job controller ended every pod; resumed, new ones run.
        restarted = eventually(lambda: resumed_pods(read, pods, first, 2), PATIENCE_S,
                               what="the TrainJob resumed, 2 new pods running")  # fmt: skip
        assert node not in {pod.spec.node_name for pod in restarted}, "a restarted pod landed on the cordoned node"
        assert not {pod.metadata.uid for pod in pods()} & first, "every pod of the hung attempt ended"
        assert all(injected(pod) for pod in restarted)
        [event] = eventually(lambda: owner_events(api, namespace, uid, "Restarting"), PATIENCE_S, what="Restarting")
        assert event.type == "Warning" and event.involved_object.kind == "TrainJob" and node in event.message

        eventually(lambda: read()["metadata"]["annotations"].get("rankwatch.io/health") == "Healthy", PATIENCE_S,
                   what="the restarted TrainJob watched again, healthy")  # fmt: skip
        described = describe_cli(kubeconfig, namespace, "trainjob/rerun-train")
        assert f"  Restart:     {record['restart']}" in described and "  Active:      false" in described
        second_look(api, Group(*TRAINJOB_GROUP, namespace, "rerun-train", uid), read)
        assert read()["metadata"]["annotations"]["rankwatch.io/restarts"] == "1"
        assert not read()["spec"].get("suspend")
        conditions = (read().get("status") or {}).get("conditions") or []
        assert not [c for c in conditions if c["type"] == "Failed" and c["status"] == "True"], "the suspend fails none"
    assert_no_refused_call(tmp_path / "operator.log")


def test_a_hang_in_a_trainjob_queued_for_kueue_restarts_through_its_jobsets_failure_policy(
    watching, trainer_controller, api, unwatched_namespace, eventually, alert_sink, tmp_path
):  # fmt: skip
    """Kueue owns its spec.suspend; its runtime gives its JobSet a failurePolicy: that restarts the group."""
    from rankwatch.operator.kinds.adapter import Group

    namespace = unwatched_namespace
    core = kubernetes.client.CoreV1Api(api)
    runtime = create_runtime_of_nodes(api, namespace, 2, failure_policy={"maxRestarts": 2})
    attempt = {"name": "RANKWATCH_ATTEMPT", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.labels['jobset.sigs.k8s.io/restart-attempt']"}}}  # fmt: skip
    with watching("kueue-train"):
        uid = create_trainjob(api, namespace, "kueue-train", HANG_IN_FIRST_ATTEMPT, runtime=runtime,
                              labels={"kueue.x-k8s.io/queue-name": "team"}, env=(attempt,))  # fmt: skip

        def read() -> dict[str, Any]:
            return read_trainjob(api, namespace, "kueue-train")

        record = eventually(lambda: settled_restart(read), PATIENCE_S, interval=1, what="the TrainJob's restart")
        assert record["kind"] == "Hang" and record["ranks"] == [2], record
        [node] = record["nodes"]
        assert record["restart"].startswith("ended child Job kueue-train-node-0 (activeDeadlineSeconds)"), record
        assert "restart 1 of at most 2" in record["restart"] and record["active"] is False
        assert not read()["spec"].get("suspend"), "Kueue's spec.suspend untouched"
        [event] = eventually(lambda: owner_events(api, namespace, uid, "Restarting"), PATIENCE_S, what="Restarting")
        assert event.involved_object.kind == "TrainJob" and node in event.message

        # The JobSet controller recreated every child Job: the pods of restart-attempt 1 run, none on the node.
        selector = "jobset.sigs.k8s.io/jobset-name=kueue-train,jobset.sigs.k8s.io/restart-attempt=1"

        def new_pods() -> list[Any]:
            pods = core.list_namespaced_pod(namespace, label_selector=selector).items
            return len(pods) == 2 and all(p.status.phase == "Running" for p in pods) and pods

        restarted = eventually(new_pods, PATIENCE_S, what="the restarted TrainJob's 2 pods running")
        assert node not in {pod.spec.node_name for pod in restarted}, "a restarted pod landed on the cordoned node"
        assert all(injected(pod) for pod in restarted)
        eventually(lambda: read()["metadata"]["annotations"].get("rankwatch.io/health") == "Healthy", PATIENCE_S,
                   what="the restarted TrainJob watched again, healthy")  # fmt: skip
        second_look(api, Group(*TRAINJOB_GROUP, namespace, "kueue-train", uid), read)
        conditions = (read().get("status") or {}).get("conditions") or []
        assert not [c for c in conditions if c["type"] == "Failed" and c["status"] == "True"]
    assert_no_refused_call(tmp_path / "operator.log")


def test_a_trainjob_rankwatch_left_suspended_is_resumed_by_the_next_operator_and_no_other(
    watching, trainer_controller, api, unwatched_namespace, eventually, alert_sink
):  # fmt: skip
    """An operator that stopped between suspending a TrainJob and resuming it: the next one resumes it (the
    mark on the TrainJob, not memory, says so); a TrainJob its user suspended stays suspended."""
    namespace = unwatched_namespace
    mark = {"rankwatch.io/restart-suspended": "2026-11-28T18:00:00Z"}
    create_trainjob(api, namespace, "left-train", {}, suspend=True, annotations=mark)
    create_trainjob(api, namespace, "held-train", {}, suspend=True)
    with watching("left-train"):

        def resumed() -> bool:
            trainjob = read_trainjob(api, namespace, "left-train")
            marked = set(mark) & set(trainjob["metadata"].get("annotations") or {})
            return not trainjob["spec"].get("suspend") and not marked

        eventually(resumed, PATIENCE_S, what="the TrainJob rankwatch suspended resumed")
        assert read_trainjob(api, namespace, "held-train")["spec"]["suspend"], "the user's suspend is the user's"


def test_trainjob_pods_made_while_the_operator_is_down_start_and_are_reported_on_the_trainjob(
    webhook, chart_rbac_kubeconfig, trainer_controller, processes, api, unwatched_namespace, eventually, tmp_path
):  # fmt: skip
    port, certs = webhook
    namespace = unwatched_namespace
    core = kubernetes.client.CoreV1Api(api)
    # No operator: the API server gets no answer from the webhook and, failing open, admits the pods.
    # The TrainJob leaves its number of nodes to its runtime (mlPolicy.numNodes 2), as the Trainer allows.
    runtime = create_runtime_of_nodes(api, namespace, 2)
    uid = create_trainjob(api, namespace, "unseen", {}, runtime=runtime)
    selector = "jobset.sigs.k8s.io/jobset-name=unseen"
    pods = eventually(
        lambda: len(p := core.list_namespaced_pod(namespace, label_selector=selector).items) == 2 and p,
        PATIENCE_S,
        what="the TrainJob's pods, with no webhook answering",
    )  # fmt: skip
    assert not any(injected(pod) for pod in pods)
    names = sorted(pod.metadata.name for pod in pods)
    # The runtime changed since: the Trainer goes on with the snapshot it took of it, and so does rankwatch.
    assert core.read_namespaced_config_map("unseen-runtime-snapshot", namespace).data["runtime"]
    kubernetes.client.CustomObjectsApi(api).patch_namespaced_custom_object(
        "trainer.kubeflow.org",
        "v1alpha1",
        namespace,
        "trainingruntimes",
        runtime,
        {"spec": {"mlPolicy": {"numNodes": 3}}},
    )

    operator = start_operator(
        processes, chart_rbac_kubeconfig, namespace, tmp_path / "operator.log", port, certs, processes.free_port()
    )
    try:

        def reported() -> list[Any]:
            events = core.list_namespaced_event(namespace, field_selector="reason=Unwatched").items
            return [e for e in events if e.involved_object.uid == uid and all(n in e.message for n in names)]

        [event] = eventually(reported, PATIENCE_S, what="the Unwatched Event on the TrainJob")
        assert event.type == "Warning" and event.involved_object.kind == "TrainJob"
        assert event.message.startswith("2 of 2 opted-in pod(s)"), "of 2: the runtime's mlPolicy.numNodes"
        assert "operator was down" in event.message
        annotations = read_trainjob(api, namespace, "unseen")["metadata"]["annotations"]
        assert annotations["rankwatch.io/unwatched-pods"] == "2"
        events = core.list_namespaced_event(namespace, field_selector="reason=Unwatched").items
        assert [e.involved_object.kind for e in events] == ["TrainJob"], "said on the TrainJob, not its JobSet"
    finally:
        stop(operator)
    assert_no_refused_call(tmp_path / "operator.log")
