"""A TrainingJob on a real cluster: applied with kubectl, run by the real operator, read back as a user would."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import kubernetes
import pytest
from trainingjobs import create_job, get_job, phase_is, small_job, worker_pods

pytestmark = pytest.mark.e2e

EXAMPLE = str(Path(__file__).parents[2] / "examples" / "trainingjob.yaml")


def test_example_job_runs_with_injected_workers(api, kubectl, namespace, eventually):
    kubectl("apply", "-n", namespace, "-f", EXAMPLE)

    status = eventually(lambda: phase_is(api, namespace, "llama-70b", "Running"), 60, what="job Running")
    assert status["workers"] == "4/4"
    assert status["health"] == "Unknown"

    pods = worker_pods(api, namespace, "llama-70b")
    assert [pod.metadata.name for pod in pods] == [f"llama-70b-worker-{i}" for i in range(4)]
    nodes = {pod.spec.node_name for pod in pods}
    assert len(nodes) == 4 and all(node.startswith("gpu-node-") for node in nodes), (
        "8 GPUs per node: one worker per node"
    )
    for index, pod in enumerate(pods):
        assert pod.status.phase == "Running"
        init_names = [c.name for c in pod.spec.init_containers]
        assert init_names == ["rankwatch-init", "rankwatch-sidecar"]
        assert pod.spec.init_containers[1].restart_policy == "Always"
        trainer = pod.spec.containers[0]
        env = {item.name: item.value for item in trainer.env}
        assert env["LD_PRELOAD"] == "/rankwatch/lib/librankwatch-nccl.so"
        assert env["NODE_RANK"] == str(index) and env["WORLD_SIZE"] == "32"
        assert env["MASTER_ADDR"] == f"llama-70b-worker-0.llama-70b.{namespace}.svc"
        assert {v.name for v in pod.spec.volumes} >= {"rankwatch-lib", "rankwatch-traces", "rankwatch-token"}
        assert pod.metadata.owner_references[0].kind == "TrainingJob"

    core = kubernetes.client.CoreV1Api(api)
    service = core.read_namespaced_service("llama-70b", namespace)
    assert service.spec.cluster_ip == "None"
    secret = core.read_namespaced_secret("llama-70b-rankwatch-token", namespace)
    assert len(secret.data["token"]) > 40

    table = kubectl("get", "tj", "-n", namespace).stdout
    header, row = table.splitlines()[:2]
    assert header.split() == ["NAME", "PHASE", "REASON", "HEALTH", "SUSPECTS", "STEP", "TIME", "RESTARTS", "AGE"]
    assert row.split()[:4] == ["llama-70b", "Running", "AllWorkersRunning", "Unknown"]

    described = kubectl("describe", "tj", "llama-70b", "-n", namespace).stdout
    for text in ("Conditions:", "AllWorkersRunning", "AwaitingTelemetry", "Events:", "Created", "rankwatch-operator"):
        assert text in described, f"{text!r} missing from kubectl describe:\n{described}"


def test_reapplying_the_manifest_changes_nothing(api, kubectl, namespace, eventually):
    kubectl("apply", "-n", namespace, "-f", EXAMPLE)
    eventually(lambda: phase_is(api, namespace, "llama-70b", "Running"), 60, what="job Running")
    before = {pod.metadata.name: pod.metadata.uid for pod in worker_pods(api, namespace, "llama-70b")}
    assert "unchanged" in kubectl("apply", "-n", namespace, "-f", EXAMPLE).stdout
    after = {pod.metadata.name: pod.metadata.uid for pod in worker_pods(api, namespace, "llama-70b")}
    assert after == before


def test_deleting_the_job_removes_its_pods_service_and_secret(api, kubectl, namespace, eventually):
    kubectl("apply", "-n", namespace, "-f", EXAMPLE)
    eventually(lambda: phase_is(api, namespace, "llama-70b", "Running"), 60, what="job Running")
    kubectl("delete", "-n", namespace, "tj", "llama-70b", "--wait=true")
    core = kubernetes.client.CoreV1Api(api)
    eventually(lambda: not worker_pods(api, namespace, "llama-70b"), 60, what="pods garbage-collected")
    eventually(
        lambda: not core.list_namespaced_service(namespace, label_selector="rankwatch.io/job-name=llama-70b").items,
        60,
        what="service garbage-collected",
    )
    assert not core.list_namespaced_secret(namespace, label_selector="rankwatch.io/job-name=llama-70b").items


def test_workers_that_finish_complete_the_job(api, namespace, eventually):
    # kwok ends each worker after 2 s with the exit code the annotation asks for.
    finish = {"kwok.rankwatch.io/exit-code": "0", "kwok.rankwatch.io/run-duration": "2s"}
    create_job(api, namespace, small_job("finishes", annotations=finish))
    status = eventually(lambda: phase_is(api, namespace, "finishes", "Succeeded"), 60, what="job Succeeded")
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Succeeded"]["status"] == "True"
    assert conditions["Running"]["status"] == "False"
    assert status["completionTime"] >= status["startTime"]


def test_a_failing_worker_fails_the_job_with_its_exit_code(api, kubectl, namespace, eventually):
    crash = {"kwok.rankwatch.io/exit-code": "3", "kwok.rankwatch.io/run-duration": "2s"}
    create_job(api, namespace, small_job("crashes", annotations=crash))
    status = eventually(lambda: phase_is(api, namespace, "crashes", "Failed"), 60, what="job Failed")
    assert "exited with code 3 (Error)" in status["message"]
    assert "on node gpu-node-" in status["message"]
    events = kubectl(
        "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=crashes", "-o", "json"
    ).stdout
    warnings = [e for e in json.loads(events)["items"] if e["type"] == "Warning"]
    assert any(e["reason"] == "WorkerFailed" and "code 3" in e["message"] for e in warnings)


@pytest.mark.parametrize(
    ("reason", "message"),
    [
        ("ImagePullBackOff", 'Back-off pulling image "registry.example.com/trainer:1": ErrImagePull: 401 Unauthorized'),
        ("CreateContainerConfigError", 'secret "wandb-key" not found'),
        ("CrashLoopBackOff", "back-off 40s restarting failed container=trainer"),
    ],
)
def test_a_worker_that_cannot_start_shows_its_reason_on_the_job(api, kubectl, namespace, eventually, reason, message):
    # kwok reports the containers waiting as the kubelet would (cluster/kwok-stages.yaml, rankwatch-pod-waiting).
    waiting = {"kwok.rankwatch.io/waiting-reason": reason, "kwok.rankwatch.io/waiting-message": message}
    job = small_job("stuck", replicas=1, annotations=waiting)
    job["spec"]["tracing"] = {"imagePullSecrets": [{"name": "team-registry"}]}  # for rankwatch's own image
    create_job(api, namespace, job)

    def said() -> dict | None:
        status = get_job(api, namespace, "stuck").get("status", {})
        return status if status.get("reason") == reason else None

    status = eventually(said, 60, what=f"the job's reason {reason}")
    assert status["phase"] == "Pending"
    expected = "waiting for 1 of 1 workers to start; worker 0 (pod stuck-worker-0 on node gpu-node-"
    assert status["message"].startswith(expected)
    assert f"container trainer {reason}: {message}" in status["message"]
    running = {c["type"]: c for c in status["conditions"]}["Running"]
    assert running["status"] == "False" and running["reason"] == reason and message in running["message"]
    row = kubectl("get", "tj", "stuck", "-n", namespace, "--no-headers").stdout.split()
    assert row[:3] == ["stuck", "Pending", reason]
    events = json.loads(
        kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.name=stuck", "-o", "json").stdout
    )["items"]
    assert [e["type"] for e in events if e["reason"] == reason] == ["Warning"]
    assert message in next(e["message"] for e in events if e["reason"] == reason)
    (pod,) = worker_pods(api, namespace, "stuck")
    assert [secret.name for secret in pod.spec.image_pull_secrets] == ["team-registry"]


def test_an_unschedulable_job_says_why(api, namespace, eventually):
    create_job(api, namespace, small_job("too-big", replicas=1, gpus=16))

    def blocked():
        status = get_job(api, namespace, "too-big").get("status", {})
        return status if "Insufficient nvidia.com/gpu" in status.get("message", "") else None

    status = eventually(blocked, 60, what="an Unschedulable message")
    assert status["phase"] == "Pending"
    assert {c["type"]: c for c in status["conditions"]}["Running"]["reason"] == "WorkersUnschedulable"


def test_a_template_that_sets_managed_env_fails_clearly(api, namespace, eventually):
    job = small_job("bad-env")
    job["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "WORLD_SIZE", "value": "3"}]
    create_job(api, namespace, job)
    status = eventually(lambda: phase_is(api, namespace, "bad-env", "Failed"), 30, what="job Failed")
    assert "sets WORLD_SIZE, which rankwatch manages" in status["message"]
    assert not worker_pods(api, namespace, "bad-env"), "nothing is created from a refused template"


def test_a_template_that_binds_workers_to_a_node_fails_clearly(api, namespace, eventually):
    job = small_job("pinned")
    job["spec"]["template"]["spec"]["nodeName"] = "gpu-node-3"
    create_job(api, namespace, job)
    status = eventually(lambda: phase_is(api, namespace, "pinned", "Failed"), 30, what="job Failed")
    assert "spec.template.spec.nodeName is not allowed" in status["message"]
    assert not worker_pods(api, namespace, "pinned"), "nothing is created from a refused template"


def test_a_template_the_api_server_refuses_fails_the_job_with_its_message(api, namespace, eventually):
    job = small_job("bad-name")
    job["spec"]["template"]["spec"]["containers"][0]["name"] = "Trainer_1"  # not a DNS label
    create_job(api, namespace, job)
    status = eventually(lambda: phase_is(api, namespace, "bad-name", "Failed"), 30, what="job Failed")
    assert "the API server refused Pod" in status["message"]
    assert "Trainer_1" in status["message"]


def test_a_name_taken_by_someone_else_is_not_adopted(api, namespace, eventually):
    core = kubernetes.client.CoreV1Api(api)
    core.create_namespaced_service(namespace, {"metadata": {"name": "taken"}, "spec": {"ports": [{"port": 80}]}})
    create_job(api, namespace, small_job("taken"))
    status = eventually(lambda: phase_is(api, namespace, "taken", "Failed"), 30, what="job Failed")
    assert "Service" in status["message"] and "does not belong to this TrainingJob" in status["message"]
    assert core.read_namespaced_service("taken", namespace).metadata.owner_references is None


def test_a_worker_deleted_before_the_job_starts_is_recreated(api, kubectl, namespace, eventually):
    create_job(api, namespace, small_job("regrow", replicas=2, gpus=16))  # unschedulable: stays Pending
    pods = eventually(lambda: len(worker_pods(api, namespace, "regrow")) == 2 and worker_pods(api, namespace, "regrow"))
    gone = pods[1]
    kubernetes.client.CoreV1Api(api).delete_namespaced_pod(gone.metadata.name, namespace, grace_period_seconds=0)

    def back() -> list:
        now = worker_pods(api, namespace, "regrow")
        return (
            now
            if {p.metadata.name for p in now} == {p.metadata.name for p in pods}
            and gone.metadata.uid not in {p.metadata.uid for p in now}
            else []
        )

    eventually(back, 60, what=f"{gone.metadata.name} recreated")
    events = kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.name=regrow", "-o", "json")
    assert any(e["reason"] == "Recreated" and gone.metadata.name in e["message"]
               for e in json.loads(events.stdout)["items"])  # fmt: skip


class CountingApiClient(kubernetes.client.ApiClient):
    """A client of the real API server that counts its requests by method."""

    def __init__(self, configuration: kubernetes.client.Configuration) -> None:
        super().__init__(configuration)
        self.requests: dict[str, int] = {}

    def request(self, method, url, *args, **kwargs):
        self.requests[method] = self.requests.get(method, 0) + 1
        return super().request(method, url, *args, **kwargs)


def test_a_pod_index_behind_the_api_server_creates_nothing(api, namespace, eventually):
    # At thousands of pods the operator's index lags behind the pods it just made; a status sync then
    # must not send a refused create (and a read) for each pod it has not seen yet.
    from rankwatch.operator.config import WorkerPodSettings
    from rankwatch.operator.lifecycle.status_sync import sync_status

    create_job(api, namespace, small_job("lagging", replicas=4, gpus=16))  # unschedulable: stays Pending
    eventually(
        lambda: len(worker_pods(api, namespace, "lagging")) == 4 and phase_is(api, namespace, "lagging", "Pending")
    )
    counting = CountingApiClient(api.configuration)
    sync_status(counting, namespace, "lagging", [], WorkerPodSettings())  # an index that has seen none of them
    assert counting.requests.get("POST", 0) == 0, counting.requests
    # the job and one list of its pods per status write (the operator, watching this namespace, may write
    # the status in between: a conflict, and the sync reads both again)
    assert counting.requests["GET"] <= 2 * max(1, counting.requests.get("PATCH", 0)), counting.requests


def test_listing_a_pending_jobs_pod_names_costs_their_names_not_their_pods(api, unwatched_namespace):
    # Status sync lists a Pending job's pods on every sync; as full V1Pod models that was ~0.2 MiB of heap
    # per pod, which the operator's resident memory kept (0.27 MiB per pod at 1,600 pods).
    import tracemalloc

    from rankwatch.kube import drain, pod_names

    core = kubernetes.client.CoreV1Api(api)
    label = {"rankwatch.io/job-name": "wide"}
    container = {
        "name": "trainer",
        "image": "trainer:1",
        "env": [{"name": f"V{i}", "value": "x" * 40} for i in range(20)],
    }
    for index in range(120):  # never scheduled (no such node): they only exist in the API
        body = {"metadata": {"name": f"wide-worker-{index}", "labels": label},
                "spec": {"nodeName": "no-such-node", "containers": [container]}}  # fmt: skip
        drain(core.create_namespaced_pod(unwatched_namespace, body, _preload_content=False))

    def peak(listing) -> tuple[object, int]:
        listing()  # connections, imports and caches first: only the list itself is measured
        tracemalloc.start()
        try:
            result = listing()
            return result, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    names, light = peak(lambda: pod_names(api, unwatched_namespace, "rankwatch.io/job-name=wide"))
    full, heavy = peak(
        lambda: core.list_namespaced_pod(unwatched_namespace, label_selector="rankwatch.io/job-name=wide")
    )
    assert names == {f"wide-worker-{index}" for index in range(120)}
    assert len(full.items) == 120
    print(f"peak heap listing 120 pods: names only {light / 2**20:.1f} MiB, full V1Pods {heavy / 2**20:.1f} MiB")
    assert light * 10 < heavy, (light, heavy)


class InFlightApiClient(kubernetes.client.ApiClient):
    """A client of the real API server that records how many POSTs it had in flight at most."""

    def __init__(self, configuration: kubernetes.client.Configuration) -> None:
        super().__init__(configuration)
        self.lock = threading.Lock()
        self.in_flight = self.most = self.posts = 0

    def request(self, method, url, *args, **kwargs):
        if method != "POST":
            return super().request(method, url, *args, **kwargs)
        with self.lock:
            self.in_flight += 1
            self.posts += 1
            self.most = max(self.most, self.in_flight)
        try:
            return super().request(method, url, *args, **kwargs)
        finally:
            with self.lock:
                self.in_flight -= 1


def test_a_jobs_pods_are_created_a_bounded_few_at_a_time_each_once(api, unwatched_namespace):
    # One after another, 8,000 pods took 332 s to make at 1,000 nodes; at once, a job would crowd out
    # every other request. No operator watches this namespace: the creates are ensure_children's alone.
    from rankwatch.operator.config import WorkerPodSettings
    from rankwatch.operator.lifecycle.children import POD_CREATES_IN_FLIGHT, ensure_children
    from rankwatch.operator.spec import TrainingJobSpec

    job = create_job(api, unwatched_namespace, small_job("wide", replicas=32))
    spec = TrainingJobSpec.from_manifest(job["spec"])
    counting = InFlightApiClient(api.configuration)
    created = ensure_children(counting, job, spec, WorkerPodSettings(), set())
    again = ensure_children(counting, job, spec, WorkerPodSettings(), set())

    names = [pod.metadata.name for pod in worker_pods(api, unwatched_namespace, "wide")]
    assert sorted(names) == sorted(f"wide-worker-{index}" for index in range(32))
    assert sorted(created) == sorted(["Secret/wide-rankwatch-token", "Service/wide", *(f"Pod/{n}" for n in names)])
    assert again == []  # everything found (409), nothing made twice
    print(f"most POSTs in flight: {counting.most} (bound {POD_CREATES_IN_FLIGHT})")
    assert 1 < counting.most <= POD_CREATES_IN_FLIGHT
