"""The control plane fails under a running operator (a real process, talking to the API server through
a relay that sees each of its requests, paging a local Feishu) while it handles a hung rank. The fault
strikes at the very moment the operator sends a request, before the API server sees it: when the
diagnosis asks for the job's pods, when it posts the Hang Event, when the cordon patches the node.

- the kube-apiserver crashes (killed) and restarts at each of the three (the request's connection
  drops, new ones are refused, for DOWN_S plus its start-up);
- etcd crashes and restarts at the pod list and at the node patch (the API server holds or fails the
  request);
- a partition between the operator and the API server (nothing refused or reset, bytes held) for
  HOLD_S at the pod list and at the Event, shorter than the operator's API timeout (the held requests
  go through), then at the node patch for three API timeouts and lossy: the connections open then are
  never answered, so only the timeout gets the operator going again (without it the cordon waits
  forever).

Each time the operator rides it out: the hang is written once, one Warning Event, the node cordoned
once (one cordon Event) and no other node, one page, and the operator is still running.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from api_relay import ApiRelay
from local_feishu import BOT_TOKEN, SIGNING_SECRET, Feishu
from trainingjobs import (
    create_job,
    detector_runs,
    diagnosed,
    events,
    judge,
    node_marks,
    node_of_pod,
    standin_job,
    stored_diagnosis,
    wait_running,
)

pytestmark = pytest.mark.e2e

DOWN_S = 2.0  # how long a restarted component stays away (then: its start-up, a few seconds)
API_TIMEOUT_S = 4.0  # the operator's RANKWATCH_API_TIMEOUT_SECONDS (30 by default): a partition outlasts it
HOLD_S = 3.0  # a partition the operator's calls outlast
# The requests a fault strikes at (method, path, body): the diagnosis' list of the job's pods (not a
# watch: kopf's have no job name in the selector), its Event, the cordon (and taint) of the node.
DIAGNOSIS_PODS = (
    "GET",
    r"^/api/v1/namespaces/[^/]+/pods\?(?!.*watch=)labelSelector=rankwatch\.io%2Fjob-name%3Dhung",
    None,
)
NODE_PATCH = ("PATCH", r"^/api/v1/nodes/[^/?]+(\?|$)", None)  # the cordon (and taint) of a node
HANG_EVENT = ("POST", r"^/api/v1/namespaces/[^/]+/events(\?|$)", rb'"reason": ?"Hang"')  # the diagnosis' Event


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
    began: float = 0.0
    metrics: str = ""
    """The operator's /metrics."""

    def note(self, text: str) -> None:
        """A line of the test's timeline, in seconds since the job was created."""
        print(f"[{time.monotonic() - self.began:6.1f} s] {text}", flush=True)

    def start_job(self) -> None:
        faults = {"RANKWATCH_STANDIN_FAULT_RANK": "2", "RANKWATCH_STANDIN_HANG_BEFORE_CALL": "300"}
        self.began = time.monotonic()
        create_job(self.api, self.namespace, standin_job(self.name, faults, remediation={"cordon": True}))
        wait_running(self.api, self.namespace, self.name, self.eventually)
        self.node = node_of_pod(self.api, self.namespace, f"{self.name}-worker-0")
        self.note("the job runs")

    def restart(self, component: str) -> Callable[[], None]:
        """An action for :meth:`ApiRelay.when`: ``component`` stops for DOWN_S and comes back; returns
        once it is stopped (its port refuses), so the request that triggered it finds it away."""
        state = yaml.safe_load(self.cluster.state_path.read_text())
        port = state["ports"][component]

        def act() -> None:
            self.wait_restarted()  # one restart at a time
            thread = threading.Thread(
                target=self.cluster.restart_component,
                args=(component, DOWN_S, self.note),
                kwargs={"grace_seconds": 0.0},  # a crash (a graceful API server stop took all 10 s of grace)
            )
            thread.start()
            self.eventually(lambda: _refuses(port), 30, interval=0.02, what=f"{component} stopped")
            self.restarted = thread

        return act

    def wait_restarted(self) -> None:
        if self.restarted is not None:
            self.restarted.join(120)

    def cut(self, seconds: float, lossy: bool = False) -> Callable[[], None]:
        """An action for :meth:`ApiRelay.when`: the link is cut for ``seconds`` from now, on a timer."""

        def act() -> None:
            self.note(f"link cut for {seconds:.0f} s{' (lossy)' if lossy else ''}")
            self.relay.cut(lossy)
            threading.Timer(seconds, self.relay.heal).start()

        return act

    def assert_handled_once(self, since: float, what: str) -> float:
        """The hang written once, one Warning Event, this node cordoned once and no other, one page."""
        job = self.eventually(lambda: diagnosed(self.api, self.namespace, self.name, "Hung"), 120, interval=0.5,
                              what="Hung=True")  # fmt: skip
        diagnosis = stored_diagnosis(job)
        assert diagnosis["kind"] == "Hang" and diagnosis["ranks"] == [2] and diagnosis["nodes"] == [self.node]

        def followed_up() -> dict | None:
            written = stored_diagnosis(diagnosed(self.api, self.namespace, self.name, "Hung"))
            return written if written.get("remediation") and written.get("alertedTime") else None

        written = self.eventually(followed_up, 120, interval=0.5, what="the cordon and the page recorded")
        self.note("diagnosis, cordon and page recorded")
        recovered_s = time.monotonic() - since
        assert written["remediation"] == f"cordoned and tainted {self.node}", written["remediation"]
        self.eventually(lambda: self.feishu.pages("TrainingJobHang"), 30, what="the page")
        # a duplicate would come from another diagnosis: the operator judges the job twice more, runs none
        self.note(f"the detector's runs: {detector_runs(self.metrics, self.namespace, self.name)}")
        judge(self.metrics, self.namespace, (self.name,), lambda: None, self.eventually, 2)
        self.note("judged twice more, no diagnosis running")
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
        latest = stored_diagnosis(diagnosed(self.api, self.namespace, self.name, "Hung"))
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
def scene(
    api, kubeconfig, cluster, unwatched_namespace, processes, eventually, tmp_path, monkeypatch
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
    monkeypatch.setenv("RANKWATCH_API_TIMEOUT_SECONDS", str(API_TIMEOUT_S))
    monkeypatch.setenv("RANKWATCH_ALERTING_CONFIG", str(tmp_path / "alerting.yaml"))
    monkeypatch.setenv("POD_NAMESPACE", namespace)  # where the alerting Secrets are
    port = processes.free_port()
    log = tmp_path / "operator.log"
    operator = processes.operator(str(relay.kubeconfig(tmp_path / "operator-kubeconfig")), namespace, log, port)
    runner = processes.pod_runner(kubeconfig, f"http://127.0.0.1:{port}", namespace, tmp_path / "pods")
    scene = Scene(api, cluster, relay, feishu, namespace, operator, log, eventually)
    scene.metrics = f"http://127.0.0.1:{port}/metrics"
    try:
        yield scene
    finally:
        scene.wait_restarted()
        uncordon_job(api, namespace, scene.name, via="test")
        processes.stop(runner)
        processes.stop(operator)
        relay.close()
        feishu.stop()
        print(log.read_text(errors="replace")[-3000:])


STRIKES = {"the pod list": DIAGNOSIS_PODS, "the Hang Event": HANG_EVENT, "the node patch": NODE_PATCH}


@pytest.mark.parametrize(
    "component, strikes",
    [("kube-apiserver", list(STRIKES)), ("etcd", ["the pod list", "the node patch"])],
    ids=["apiserver", "etcd"],
)
def test_control_plane_restarts_at_the_diagnosis_and_cordon_writes_repeat_and_lose_nothing(scene, component, strikes):
    fired = {what: scene.relay.when(*STRIKES[what], scene.restart(component)) for what in strikes}
    scene.start_job()
    for what, struck in fired.items():
        scene.eventually(struck.is_set, 120, interval=0.2, what=f"the operator's request: {what}")
    scene.wait_restarted()
    scene.assert_handled_once(time.monotonic(), f"{component} restarted at {', '.join(strikes)}")


def test_partitions_at_the_diagnosis_and_cordon_writes_even_past_the_api_timeout_lose_nothing(scene):
    lossy_s = 3 * API_TIMEOUT_S
    fired = [
        scene.relay.when(*DIAGNOSIS_PODS, scene.cut(HOLD_S)),
        scene.relay.when(*HANG_EVENT, scene.cut(HOLD_S)),
        scene.relay.when(*NODE_PATCH, scene.cut(lossy_s, lossy=True)),
    ]
    scene.start_job()
    for struck, what in zip(fired, STRIKES, strict=True):
        scene.eventually(struck.is_set, 120, interval=0.2, what=f"the operator's request: {what}")
    time.sleep(lossy_s)
    recovered_s = scene.assert_handled_once(
        time.monotonic(),
        f"partitioned {HOLD_S:.0f} s at the pod list and the Event, {lossy_s:.0f} s (lossy) at the node patch",
    )
    assert recovered_s < 10 * API_TIMEOUT_S, "the calls cut off were retried soon after the partition healed"


def test_a_node_patch_answered_503_then_its_answer_lost_cordons_once_with_one_event(scene):
    """The cordon's node patch meets a 503 (the API server's passing failure), then its next try lands
    but its answer is lost: the operator tries again, finds its own mark and posts the cordon Event once."""
    fired = [scene.relay.answer(*NODE_PATCH, 503), scene.relay.lose_answer(*NODE_PATCH)]
    scene.start_job()
    for struck, what in zip(fired, ("a 503", "a lost answer"), strict=True):
        scene.eventually(struck.is_set, 120, interval=0.2, what=f"the node patch: {what}")
    scene.assert_handled_once(time.monotonic(), "the node patch answered 503, then its answer lost")
