"""The operator as a real process (`rankwatch operator`), killed mid-way and restarted."""

from __future__ import annotations

import signal
import subprocess
from collections import Counter

import kubernetes
import pytest

pytestmark = pytest.mark.e2e

REPLICAS = 40


def test_operator_killed_mid_creation_converges_without_duplicates(
    processes, api, kubeconfig, unwatched_namespace, eventually, tmp_path
):
    namespace = unwatched_namespace
    core = kubernetes.client.CoreV1Api(api)
    jobs = kubernetes.client.CustomObjectsApi(api)
    log = tmp_path / "operator.log"

    def pods():
        return core.list_namespaced_pod(namespace, label_selector="rankwatch.io/job-name=big").items

    operator = processes.operator(kubeconfig, namespace, log, 0)  # its own collector on a free port
    try:
        jobs.create_namespaced_custom_object(
            "rankwatch.io",
            "v1alpha1",
            namespace,
            "trainingjobs",
            {
                "apiVersion": "rankwatch.io/v1alpha1",
                "kind": "TrainingJob",
                "metadata": {"name": "big"},
                "spec": {
                    "replicas": REPLICAS,
                    "nprocPerNode": 1,
                    "template": {"spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]}},
                },
            },
        )
        eventually(pods, 60, interval=0.05, what="the first worker pod")
        operator.send_signal(signal.SIGKILL)  # no chance to finish or clean up
        operator.wait(10)
        created_before_kill = len(pods())

        operator = processes.operator(kubeconfig, namespace, log, 0)  # its own collector on a free port
        eventually(lambda: len(pods()) >= REPLICAS, 120, what=f"{REPLICAS} pods after restart")

        def running():
            status = jobs.get_namespaced_custom_object(
                "rankwatch.io", "v1alpha1", namespace, "trainingjobs", "big"
            ).get("status", {})
            return status if status.get("phase") == "Running" else None

        status = eventually(running, 120, what="job Running after restart")
        names = Counter(pod.metadata.name for pod in pods())
        assert sorted(names) == sorted(f"big-worker-{i}" for i in range(REPLICAS))
        assert set(names.values()) == {1}
        assert status["workers"] == f"{REPLICAS}/{REPLICAS}"
        assert len(core.list_namespaced_service(namespace, label_selector="rankwatch.io/job-name=big").items) == 1
        assert len(core.list_namespaced_secret(namespace, label_selector="rankwatch.io/job-name=big").items) == 1
        print(f"pods created before the kill: {created_before_kill}/{REPLICAS}")
    finally:
        operator.terminate()
        try:
            operator.wait(15)
        except subprocess.TimeoutExpired:
            operator.kill()
        print(log.read_text()[-3000:])
