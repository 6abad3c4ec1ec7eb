"""Gang admission with the real Kueue controller: a TrainingJob in a Kueue queue runs all its workers
or none. Kueue (built from its Go module, pinned in cluster/versions.py) runs beside the local
cluster with its webhooks registered; rankwatch's workers form one Kueue pod group."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import pytest
from trainingjobs import create_job, phase_is, small_job, worker_pods

pytestmark = pytest.mark.e2e

KUEUE = ("kueue.x-k8s.io", "v1beta2")
ADMISSION_GATE = "kueue.x-k8s.io/admission"


@pytest.fixture(scope="module")
def kueue(kubeconfig: str) -> Iterator[None]:
    """The real Kueue on the tests' local cluster; unregistered and stopped afterwards, so the other
    tests' pods never pass its webhooks."""
    if os.environ.get("RANKWATCH_USE_KUBECONFIG") == "1":
        pytest.skip("runs Kueue beside the built-in local cluster only")
    from rankwatch.cluster.kueue import LocalKueue
    from rankwatch.cluster.local import LocalCluster
    from rankwatch.cluster.state import ClusterState

    root = os.environ.get("RANKWATCH_TEST_CLUSTER_DIR") or os.path.expanduser("~/.rankwatch/test-cluster")
    cluster = LocalCluster(Path(root))
    state = ClusterState.load(cluster.state_path)
    assert state is not None
    local = LocalKueue(cluster)
    try:
        local.up(state, lambda message: print(f"[kueue] {message}", flush=True), time.monotonic() + 180)
    finally:
        state.save(cluster.state_path)
    yield
    local.stop(state, print)
    state.save(cluster.state_path)
    # Its CRDs go too (their conversion webhook points at the stopped Kueue): the cluster as found.
    extensions = kubernetes.client.ApiextensionsV1Api(kubernetes.config.new_client_from_config(kubeconfig))
    for crd in extensions.list_custom_resource_definition().items:
        if crd.spec.group == KUEUE[0]:
            extensions.delete_custom_resource_definition(crd.metadata.name)


def custom(api) -> kubernetes.client.CustomObjectsApi:
    return kubernetes.client.CustomObjectsApi(api)


def make_queues(api, namespace: str, gpus: int) -> str:
    """A ResourceFlavor, a ClusterQueue with ``gpus`` of GPU quota (CPU and memory plenty) and the
    namespace's LocalQueue ``team``; returns the ClusterQueue's name."""
    objects = custom(api)
    flavor = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "gpu-nodes"}}
    try:
        objects.create_cluster_custom_object(*KUEUE, "resourceflavors", flavor)
    except kubernetes.client.ApiException as error:
        if error.status != 409:
            raise
    cluster_queue = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ClusterQueue",
        "metadata": {"name": namespace},
        "spec": {
            "namespaceSelector": {},
            "resourceGroups": [
                {
                    "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
                    "flavors": [
                        {
                            "name": "gpu-nodes",
                            "resources": [
                                {"name": "cpu", "nominalQuota": "1000"},
                                {"name": "memory", "nominalQuota": "10000Gi"},
                                {"name": "nvidia.com/gpu", "nominalQuota": gpus},
                            ],
                        }
                    ],
                }
            ],
        },
    }
    objects.create_cluster_custom_object(*KUEUE, "clusterqueues", cluster_queue)
    local_queue = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "LocalQueue",
        "metadata": {"name": "team", "namespace": namespace},
        "spec": {"clusterQueue": namespace},
    }
    objects.create_namespaced_custom_object(*KUEUE, namespace, "localqueues", local_queue)
    return namespace


def workloads(api, namespace: str) -> list[dict]:
    return custom(api).list_namespaced_custom_object(*KUEUE, namespace, "workloads")["items"]


def pending_for_quota(api, namespace: str) -> dict | None:
    """The job's one Workload once Kueue has tried it and found no quota (QuotaReserved False)."""
    found = workloads(api, namespace)
    if len(found) != 1:
        return None
    conditions = {c["type"]: c for c in (found[0].get("status") or {}).get("conditions") or []}
    reserved = conditions.get("QuotaReserved")
    return found[0] if reserved and reserved["status"] == "False" and reserved.get("message") else None


@pytest.fixture
def cleanup_cluster_queue(api) -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        custom(api).delete_cluster_custom_object(*KUEUE, "clusterqueues", name)


def test_a_gang_that_does_not_fit_its_quota_holds_no_gpus_until_it_all_fits(
    api, namespace, eventually, kueue, cleanup_cluster_queue
):
    cluster_queue = make_queues(api, namespace, gpus=8)
    cleanup_cluster_queue.append(cluster_queue)
    job = small_job("gang", replicas=2, gpus=8)  # 16 GPUs wanted, 8 in the queue's quota
    job["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team"}
    create_job(api, namespace, job)

    workload = eventually(lambda: pending_for_quota(api, namespace), 90, what="Kueue's verdict on the job's Workload")
    [pod_set] = workload["spec"]["podSets"]
    assert pod_set["count"] == 2, "Kueue sees both workers as one gang"
    reserved = next(c for c in workload["status"]["conditions"] if c["type"] == "QuotaReserved")
    assert "nvidia.com/gpu" in reserved["message"], reserved
    pods = worker_pods(api, namespace, "gang")
    assert len(pods) == 2
    for pod in pods:
        gates = [gate.name for gate in pod.spec.scheduling_gates or []]
        assert ADMISSION_GATE in gates, f"{pod.metadata.name} is not held by Kueue: {gates}"
        assert pod.spec.node_name is None, f"{pod.metadata.name} holds a node's GPUs: {pod.spec.node_name}"
    status = eventually(
        lambda: (s := phase_is(api, namespace, "gang", "Pending")) and s.get("reason") == "AwaitingAdmission" and s,
        60,
        what="the job awaiting admission",
    )
    assert ADMISSION_GATE in status["message"]

    # Quota for the whole gang: Kueue admits it, lifts both gates, and both workers run.
    custom(api).patch_cluster_custom_object(
        *KUEUE,
        "clusterqueues",
        cluster_queue,
        {
            "spec": {
                "resourceGroups": [
                    {
                        "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
                        "flavors": [
                            {
                                "name": "gpu-nodes",
                                "resources": [
                                    {"name": "cpu", "nominalQuota": "1000"},
                                    {"name": "memory", "nominalQuota": "10000Gi"},
                                    {"name": "nvidia.com/gpu", "nominalQuota": 16},
                                ],
                            }
                        ],
                    }
                ]
            }
        },
    )
    status = eventually(lambda: phase_is(api, namespace, "gang", "Running"), 90, what="the admitted gang running")
    assert status["workers"] == "2/2"
    assert all(pod.spec.node_name and not pod.spec.scheduling_gates for pod in worker_pods(api, namespace, "gang"))


def test_suspending_a_queued_job_gives_its_quota_back(api, namespace, eventually, kueue, cleanup_cluster_queue):
    cleanup_cluster_queue.append(make_queues(api, namespace, gpus=16))
    job = small_job("queued", replicas=2, gpus=8)
    job["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team"}
    create_job(api, namespace, job)
    eventually(lambda: phase_is(api, namespace, "queued", "Running"), 90, what="the admitted job running")

    custom(api).patch_namespaced_custom_object(
        "rankwatch.io", "v1alpha1", namespace, "trainingjobs", "queued", {"spec": {"suspend": True}}
    )
    eventually(lambda: not worker_pods(api, namespace, "queued"), 60, what="worker pods deleted")

    def quota_free() -> bool:
        queue = custom(api).get_cluster_custom_object(*KUEUE, "clusterqueues", namespace)
        usage = (queue.get("status") or {}).get("flavorsUsage") or []
        used = [r for flavor in usage for r in flavor["resources"] if r["name"] == "nvidia.com/gpu"]
        return bool(used) and all(str(r.get("total", "0")) == "0" for r in used)

    eventually(quota_free, 60, what="the ClusterQueue's GPUs free again")

    # Resumed, the workers are a new pod group that Kueue admits anew.
    custom(api).patch_namespaced_custom_object(
        "rankwatch.io", "v1alpha1", namespace, "trainingjobs", "queued", {"spec": {"suspend": False}}
    )
    status = eventually(lambda: phase_is(api, namespace, "queued", "Running"), 90, what="the resumed job running")
    assert status["workers"] == "2/2"
