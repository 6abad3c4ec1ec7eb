"""The control plane fails under a running operator (a real process, talking to the API server through
a relay that sees each of its requests, paging a local Feishu) while it handles a hung rank:

- during the diagnosis: the kube-apiserver (connections refused) or etcd (the API server holds or
  fails requests) stops for 5 s the moment the operator starts diagnosing, or the operator is cut off
  from the API server for 10 s then;
- during the cordon's own writes: the API server restarts, or the link is cut, at the very moment the
  operator sends the node's cordon patch (or the diagnosis' Event), before the API server sees it;
- longer than the operator's API timeout: the link is cut, losing the connections open then (the
  operator's calls on them are never answered), for three times the timeout.

Each time the operator rides it out: the hang is written once, one Warning Event, the node cordoned
once and no other, one page, and the operator is still running.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: the diagnosis tests' job helpers
from api_relay import ApiRelay
from local_feishu import BOT_TOKEN, SIGNING_SECRET, Feishu
from test_diagnosis import WINDOW, create_job, diagnosed, events, node_marks, node_of_pod, standin_job, wait_running

pytestmark = pytest.mark.e2e

DOWN_S = 5.0  # how long a component stays away
PARTITION_S = 10.0  # how long the operator cannot reach the API server
SHORT_API_TIMEOUT_S = 4.0  # RANKWATCH_API_TIMEOUT_SECONDS where a partition is to outlast it
NODE_PATCH = ("PATCH", r"^/api/v1/nodes/[^/?]+(\?|$)", None)  # the cordon (and taint) of a node
HANG_EVENT = ("POST", r"^/api/v1/namespaces/[^/]+/events(\?|$)", rb'"reason": ?"Hang"')  # the diagnosis' Event


def wait_for_line(log: Path, start: str, end: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any(f"] {start}" in line and line.endswith(end) for line in log.read_text(errors="replace").splitlines()):
        assert time.monotonic() < deadline, f"no line {start}...{end} in the operator's log"
        time.sleep(0.1)


def _refuses(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


@dataclass
class Scene:
    """The operator through the relay, and (once :meth:`start_job` ran) a job whose rank 2 hangs."""

    api: kubernetes.client.ApiClient
    cluster: Any  # LocalCluster
    relay: ApiRelay
    feishu: Feishu
    namespace: str
    operator: Any  # subprocess.Popen
    log: Path
    eventually: Callable[..., Any]
    name: str = "hung"
    node: str = ""
    restarted: threading.Thread | None = None
    """The restart an action started (the test waits for it)."""

    def start_job(self) -> None:
        faults = {"RANKWATCH_STANDIN_FAULT_RANK": "2", "RANKWATCH_STANDIN_HANG_BEFORE_CALL": "300"}
        create_job(self.api, self.namespace, standin_job(self.name, faults, remediation={"cordon": True}))
        wait_running(self.api, self.namespace, self.name, self.eventually)
        self.node = node_of_pod(self.api, self.namespace, f"{self.name}-worker-0")

    def wait_for_diagnosing(self) -> None:
        """Until the detector's suspicion is logged: the diagnosis then asks the API for the job's pods,
        and its report, status, Event and cordon are written through the API."""
        wait_for_line(self.log, f"TrainingJob {self.namespace}/{self.name}: ", "; diagnosing", 90)

    def restart(self, component: str) -> Callable[[], None]:
        """An action for :meth:`ApiRelay.when`: ``component`` stops for DOWN_S and comes back; returns
        once it is stopped (its port refuses), so the request that triggered it finds it away."""
        state = yaml.safe_load(self.cluster.state_path.read_text())
        port = state["ports"][component]

        def act() -> None:
            thread = threading.Thread(target=self.cluster.restart_component, args=(component, DOWN_S, print))
            thread.start()
            self.eventually(lambda: _refuses(port), 30, interval=0.02, what=f"{component} stopped")
            self.restarted = thread

        return act

    def cut(self, seconds: float, lossy: bool = False) -> Callable[[], None]:
        """An action for :meth:`ApiRelay.when`: the link is cut for ``seconds`` from now, on a timer."""

        def act() -> None:
            self.relay.cut(lossy)
            threading.Timer(seconds, self.relay.heal).start()

        return act

    def assert_handled_once(self, since: float, what: str) -> float:
        """The hang written once, one Warning Event, this node cordoned once and no other, one page."""
        job = self.eventually(lambda: diagnosed(self.api, self.namespace, self.name, "Hung"), 120, interval=0.5,
                              what="Hung=True")  # fmt: skip
        diagnosis = job["status"]["diagnosis"]
        assert diagnosis["kind"] == "Hang" and diagnosis["ranks"] == [2] and diagnosis["nodes"] == [self.node]

        def followed_up() -> dict | None:
            written = diagnosed(self.api, self.namespace, self.name, "Hung")["status"]["diagnosis"]
            return written if written.get("remediation") and written.get("alertedTime") else None

        written = self.eventually(followed_up, 120, interval=0.5, what="the cordon and the page recorded")
        recovered_s = time.monotonic() - since
        assert written["remediation"] == f"cordoned and tainted {self.node}", written["remediation"]
        self.eventually(lambda: self.feishu.pages("TrainingJobHang"), 30, what="the page")
        time.sleep(3 * WINDOW)  # time enough for a duplicate to show
        unschedulable, _, marks = node_marks(self.api, self.node)
        assert unschedulable and marks.get("rankwatch.io/cordon-job") == f"{self.namespace}/{self.name}", marks
        core = kubernetes.client.CoreV1Api(self.api)
        others = [n.metadata.name for n in core.list_node().items if n.metadata.name != self.node]
        job_ref = f"{self.namespace}/{self.name}"
        assert not [n for n in others if node_marks(self.api, n)[2].get("rankwatch.io/cordon-job") == job_ref]
        hangs = [e for e in events(self.api, self.namespace, self.name) if e.reason == "Hang"]
        assert len(hangs) == 1 and hangs[0].type == "Warning" and (hangs[0].count or 1) == 1, hangs
        cordons = [
            e
            for e in core.list_namespaced_event("default").items
            if e.involved_object.name == self.node
            and e.reason == "CordonedByRankwatch"
            and f"TrainingJob {job_ref} " in e.message
        ]
        assert len(cordons) == 1, [e.message for e in cordons]
        assert len(self.feishu.pages("TrainingJobHang")) == 1, self.feishu.pages("TrainingJobHang")
        latest = diagnosed(self.api, self.namespace, self.name, "Hung")["status"]["diagnosis"]
        assert latest["time"] == diagnosis["time"], "one diagnosis"
        assert self.operator.poll() is None, "the operator did not survive"
        print(f"{what}: hang written, cordoned and paged once, {recovered_s:.1f} s after the fault ended")
        return recovered_s


@pytest.fixture
def cluster(kubeconfig):
    if os.environ.get("RANKWATCH_USE_KUBECONFIG") == "1":
        pytest.skip("restarts components of the built-in local cluster only")
    from rankwatch.cluster.local import LocalCluster

    root = os.environ.get("RANKWATCH_TEST_CLUSTER_DIR") or os.path.expanduser("~/.rankwatch/test-cluster")
    return LocalCluster(Path(root))


@pytest.fixture
def api_timeout() -> float:
    """The operator's RANKWATCH_API_TIMEOUT_SECONDS: its default, unless a test parametrizes it."""
    from rankwatch.kube import DEFAULT_REQUEST_TIMEOUT_S

    return DEFAULT_REQUEST_TIMEOUT_S


@pytest.fixture
def scene(
    api, kubeconfig, cluster, unwatched_namespace, processes, eventually, tmp_path, monkeypatch, api_timeout
) -> Iterator[Scene]:
    """The operator (a real process) for one namespace, its API calls through the relay, paging the
    local Feishu; the pod runner."""
    from rankwatch.operator.remediation.cordon import uncordon_job

    namespace = unwatched_namespace
    feishu = Feishu()
    relay = ApiRelay(Path(kubeconfig), cluster.pki, tmp_path / "relay")
    core = kubernetes.client.CoreV1Api(api)
    secret = {"webhook-url": feishu.fake.bot_url(BOT_TOKEN), "signing-secret": SIGNING_SECRET, "token": "intake"}
    core.create_namespaced_secret(namespace, {"metadata": {"name": "rankwatch-feishu"}, "stringData": secret})

    def ref(key: str) -> dict[str, Any]:
        return {"secretKeyRef": {"name": "rankwatch-feishu", "key": key}}

    alerting = {
        "receivers": [
            {"name": "feishu", "feishu": {"webhook_url": ref("webhook-url"), "secret": ref("signing-secret")}}
        ],
        "route": {"receiver": "feishu", "group_wait": "1s", "group_interval": "5s", "repeat_interval": "4h"},
        "store": {"path": str(tmp_path / "alerts")},
        "intake": {"bearer_token": ref("token")},
    }
    (tmp_path / "alerting.yaml").write_text(yaml.safe_dump(alerting))
    monkeypatch.setenv("RANKWATCH_CORDON_COOLDOWN_SECONDS", "0")  # the tests share four nodes
    monkeypatch.setenv("RANKWATCH_BREAKER_MAX_SHARE", "1")
    monkeypatch.setenv("RANKWATCH_API_TIMEOUT_SECONDS", str(api_timeout))
    monkeypatch.setenv("RANKWATCH_ALERTING_CONFIG", str(tmp_path / "alerting.yaml"))
    monkeypatch.setenv("POD_NAMESPACE", namespace)  # where the alerting Secrets are
    port = processes.free_port()
    log = tmp_path / "operator.log"
    operator = processes.operator(str(relay.kubeconfig(tmp_path / "operator-kubeconfig")), namespace, log, port)
    runner = processes.pod_runner(kubeconfig, f"http://127.0.0.1:{port}", namespace, tmp_path / "pods")
    scene = Scene(api, cluster, relay, feishu, namespace, operator, log, eventually)
    try:
        yield scene
    finally:
        if scene.restarted is not None:
            scene.restarted.join(120)
        uncordon_job(api, namespace, scene.name, via="test")
        processes.stop(runner)
        processes.stop(operator)
        relay.close()
        feishu.stop()
        print(log.read_text(errors="replace")[-3000:])


@pytest.mark.parametrize("component", ["kube-apiserver", "etcd"], ids=["apiserver", "etcd"])
def test_a_control_plane_restart_during_the_diagnosis_repeats_and_loses_nothing(scene, component):
    scene.start_job()
    scene.wait_for_diagnosing()
    ready_s = scene.cluster.restart_component(component, DOWN_S, log=lambda m: print(f"[cluster] {m}", flush=True))
    scene.assert_handled_once(time.monotonic(), f"{component} restarted while diagnosing (ready {ready_s:.1f} s)")


def test_a_partition_during_the_diagnosis_repeats_and_loses_nothing(scene):
    scene.start_job()
    scene.wait_for_diagnosing()
    scene.cut(PARTITION_S)()
    time.sleep(PARTITION_S)
    scene.assert_handled_once(time.monotonic(), f"partitioned {PARTITION_S:.0f} s while diagnosing")


@pytest.mark.parametrize(
    "fault, write",
    [("kube-apiserver", NODE_PATCH), ("etcd", NODE_PATCH), ("partition", NODE_PATCH), ("kube-apiserver", HANG_EVENT)],
    ids=["apiserver-at-the-cordon", "etcd-at-the-cordon", "partition-at-the-cordon", "apiserver-at-the-event"],
)
def test_a_fault_at_the_cordon_writes_repeats_and_loses_nothing(scene, fault, write):
    action = scene.cut(PARTITION_S) if fault == "partition" else scene.restart(fault)
    fired = scene.relay.when(*write, action)
    scene.start_job()
    scene.eventually(fired.is_set, 120, interval=0.2, what=f"the operator's {write[0]} {write[1]}")
    began = time.monotonic()
    if fault == "partition":
        time.sleep(PARTITION_S)
    else:
        scene.restarted.join(120)
    scene.assert_handled_once(
        time.monotonic(), f"{fault} at the operator's {write[0]} (fault {time.monotonic() - began:.1f} s)"
    )


@pytest.mark.parametrize("api_timeout", [SHORT_API_TIMEOUT_S])
def test_a_partition_longer_than_the_api_timeout_is_ridden_out(scene, api_timeout):
    """The link cut the moment the cordon's node patch is sent, for three API timeouts, losing every
    connection open then: without a timeout the patch (and kopf's watches) would wait forever."""
    lasting = 3 * api_timeout
    fired = scene.relay.when(*NODE_PATCH, scene.cut(lasting, lossy=True))
    scene.start_job()
    scene.eventually(fired.is_set, 120, interval=0.2, what="the cordon's node patch")
    time.sleep(lasting)
    recovered_s = scene.assert_handled_once(time.monotonic(), f"lossy partition of {lasting:.0f} s at the cordon")
    assert recovered_s < 10 * api_timeout, "the calls cut off were retried soon after the partition healed"
