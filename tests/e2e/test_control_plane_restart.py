"""The control plane fails under a running operator: the local cluster's kube-apiserver (connections
refused) or etcd (the API server holds or fails requests) is stopped for 5 s the moment the operator
starts diagnosing a hang, then started again; or the operator is cut off from the API server for 10 s
at that moment. The operator (a real process) rides it out: the hang is written once, one Warning
Event, one node cordoned, and the operator is still running."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from pathlib import Path

import kubernetes
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: the diagnosis tests' job helpers
from test_diagnosis import WINDOW, create_job, diagnosed, events, node_marks, node_of_pod, standin_job, wait_running

pytestmark = pytest.mark.e2e

DOWN_S = 5.0  # how long the component stays away
PARTITION_S = 10.0  # how long the operator cannot reach the API server


@pytest.fixture
def cluster(kubeconfig):
    if os.environ.get("RANKWATCH_USE_KUBECONFIG") == "1":
        pytest.skip("restarts components of the built-in local cluster only")
    from rankwatch.cluster.local import LocalCluster

    root = os.environ.get("RANKWATCH_TEST_CLUSTER_DIR") or os.path.expanduser("~/.rankwatch/test-cluster")
    return LocalCluster(Path(root))


def wait_for_line(log: Path, start: str, end: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any(f"] {start}" in line and line.endswith(end) for line in log.read_text(errors="replace").splitlines()):
        assert time.monotonic() < deadline, f"no line {start}...{end} in the operator's log"
        time.sleep(0.1)


@pytest.mark.parametrize("component", ["kube-apiserver", "etcd"], ids=["apiserver", "etcd"])
def test_the_operator_recovers_from_a_control_plane_restart_without_duplicates(
    api, kubeconfig, cluster, unwatched_namespace, processes, eventually, tmp_path, monkeypatch, component
):
    from rankwatch.operator.remediation.cordon import uncordon_job

    namespace, name = unwatched_namespace, "hung"
    monkeypatch.setenv("RANKWATCH_CORDON_COOLDOWN_SECONDS", "0")  # the tests share four nodes
    monkeypatch.setenv("RANKWATCH_BREAKER_MAX_SHARE", "1")
    port = processes.free_port()
    log = tmp_path / "operator.log"
    operator = processes.operator(kubeconfig, namespace, log, port)
    runner = processes.pod_runner(kubeconfig, f"http://127.0.0.1:{port}", namespace, tmp_path / "pods")
    try:
        faults = {"RANKWATCH_STANDIN_FAULT_RANK": "2", "RANKWATCH_STANDIN_HANG_BEFORE_CALL": "300"}
        create_job(api, namespace, standin_job(name, faults, remediation={"cordon": True}))
        wait_running(api, namespace, name, eventually)
        node = node_of_pod(api, namespace, f"{name}-worker-0")
        # The detector's suspicion is logged just before the diagnosis asks the API for the job's pods, and
        # the diagnosis, its Event and the cordon are written through the API.
        wait_for_line(log, f"TrainingJob {namespace}/{name}: ", "; diagnosing", 90)
        ready_s = cluster.restart_component(component, DOWN_S, log=lambda m: print(f"[cluster] {m}", flush=True))
        back = time.monotonic()

        job = eventually(lambda: diagnosed(api, namespace, name, "Hung"), 90, interval=0.5, what="Hung=True")
        diagnosis = job["status"]["diagnosis"]
        assert diagnosis["kind"] == "Hang" and diagnosis["ranks"] == [2] and diagnosis["nodes"] == [node]
        recorded = eventually(
            lambda: diagnosed(api, namespace, name, "Hung")["status"]["diagnosis"].get("remediation"),
            60,
            what="the cordon recorded",
        )
        recovered_s = time.monotonic() - back
        assert recorded == f"cordoned and tainted {node}"
        time.sleep(3 * WINDOW)  # time enough for a duplicate to show
        unschedulable, _, marks = node_marks(api, node)
        assert unschedulable and marks.get("rankwatch.io/cordon-job") == f"{namespace}/{name}", marks
        others = [
            n.metadata.name for n in kubernetes.client.CoreV1Api(api).list_node().items if n.metadata.name != node
        ]
        assert not [n for n in others if node_marks(api, n)[2].get("rankwatch.io/cordon-job") == f"{namespace}/{name}"]
        hangs = [e for e in events(api, namespace, name) if e.reason == "Hang"]
        assert len(hangs) == 1 and hangs[0].type == "Warning" and (hangs[0].count or 1) == 1, hangs
        assert diagnosed(api, namespace, name, "Hung")["status"]["diagnosis"]["time"] == diagnosis["time"]
        assert operator.poll() is None, "the operator did not survive the restart"
        print(
            f"{component} restarted while diagnosing (down {DOWN_S:.0f} s, API ready {ready_s:.1f} s after its start): "
            f"hang written and cordoned {recovered_s:.1f} s after the API answered again"
        )
    finally:
        uncordon_job(api, namespace, name, via="test")
        processes.stop(runner)
        processes.stop(operator)
        print(log.read_text(errors="replace")[-3000:])


class Partition:
    """A loopback TCP relay between the operator and the API server that can stop carrying bytes, as a
    network partition does: nothing is refused or reset, bytes are held until the link is healed."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.link = threading.Event()
        self.link.set()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        self.link.wait()
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        for source, target in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(source, target), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                self.link.wait()
                target.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, target):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.link.set()
        self.server.close()


def test_the_operator_recovers_from_a_partition_from_the_api_server(
    api, kubeconfig, cluster, unwatched_namespace, processes, eventually, tmp_path, monkeypatch
):
    from rankwatch.operator.remediation.cordon import uncordon_job

    namespace, name = unwatched_namespace, "hung"
    monkeypatch.setenv("RANKWATCH_CORDON_COOLDOWN_SECONDS", "0")
    monkeypatch.setenv("RANKWATCH_BREAKER_MAX_SHARE", "1")
    config = yaml.safe_load(Path(kubeconfig).read_text())
    upstream = int(config["clusters"][0]["cluster"]["server"].rsplit(":", 1)[1])
    partition = Partition(upstream)
    config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{partition.port}"
    through_relay = tmp_path / "operator-kubeconfig"
    through_relay.write_text(yaml.safe_dump(config))
    port = processes.free_port()
    log = tmp_path / "operator.log"
    operator = processes.operator(str(through_relay), namespace, log, port)
    runner = processes.pod_runner(kubeconfig, f"http://127.0.0.1:{port}", namespace, tmp_path / "pods")
    try:
        faults = {"RANKWATCH_STANDIN_FAULT_RANK": "2", "RANKWATCH_STANDIN_HANG_BEFORE_CALL": "300"}
        create_job(api, namespace, standin_job(name, faults, remediation={"cordon": True}))
        wait_running(api, namespace, name, eventually)
        node = node_of_pod(api, namespace, f"{name}-worker-0")
        wait_for_line(log, f"TrainingJob {namespace}/{name}: ", "; diagnosing", 90)
        partition.link.clear()
        time.sleep(PARTITION_S)
        partition.link.set()
        healed = time.monotonic()
        job = eventually(lambda: diagnosed(api, namespace, name, "Hung"), 90, interval=0.5, what="Hung=True")
        assert job["status"]["diagnosis"]["kind"] == "Hang" and job["status"]["diagnosis"]["nodes"] == [node]
        eventually(
            lambda: diagnosed(api, namespace, name, "Hung")["status"]["diagnosis"].get("remediation"),
            60,
            what="the cordon recorded",
        )
        recovered_s = time.monotonic() - healed
        time.sleep(3 * WINDOW)
        assert node_marks(api, node)[0], "the suspect node is cordoned"
        hangs = [e for e in events(api, namespace, name) if e.reason == "Hang"]
        assert len(hangs) == 1 and (hangs[0].count or 1) == 1, hangs
        assert operator.poll() is None, "the operator did not survive the partition"
        print(f"partitioned {PARTITION_S:.0f} s while diagnosing: hang written and cordoned {recovered_s:.1f} s after")
    finally:
        uncordon_job(api, namespace, name, via="test")
        processes.stop(runner)
        processes.stop(operator)
        partition.close()
        print(log.read_text(errors="replace")[-3000:])
