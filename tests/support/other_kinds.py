"""What the e2e tests of jobs of other kinds share (tests/e2e/test_other_kinds.py, test_trainjob.py): the
operator serving the admission webhook on loopback, the stand-in trainer as a Job's container, the
checks of a diagnosed group, and their fixtures (made available to every e2e test by
tests/e2e/conftest.py)."""

from __future__ import annotations

import base64
import contextlib
import os
import re
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from trainingjobs import crd_established

from rankwatch.cluster import pki

REPO = Path(__file__).parents[2]


PATIENCE_S = 300
"""How long to wait for what must happen (an operator starting, a controller acting): generous, since
the machine may be busy; a wait that ends early costs nothing."""


def indexed_job(name: str, completions: int) -> dict[str, Any]:
    """An Indexed Job whose pod template opted in, as a user writes it."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "completionMode": "Indexed",
            "completions": completions,
            "parallelism": completions,
            "backoffLimit": 0,
            "template": {
                "metadata": {"annotations": {"rankwatch.io/inject": "true", "rankwatch.io/nproc-per-node": "2"}},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {"name": "trainer", "image": "trainer:1", "command": ["torchrun", "--nproc-per-node=2", "t.py"]}
                    ],
                },
            },
        },
    }


@pytest.fixture
def webhook(helm, kubectl, kubeconfig, unwatched_namespace, processes, tmp_path):
    """The chart's webhook configuration aimed at https://127.0.0.1:<port>, the namespace opted in; yields
    (port, certificate directory). Removed afterwards (it would send this cluster's pods to a dead port)."""
    certs = tmp_path / "webhook-tls"
    pki.issue_serving(certs, ["127.0.0.1"])
    port = processes.free_port()
    release = f"kinds-{uuid.uuid4().hex[:6]}"
    ca = base64.b64encode((certs / "ca.crt").read_bytes()).decode()
    rendered = helm(
        "template", release, str(REPO / "helm" / "rankwatch"), "--namespace", "rankwatch-system",
        "--set", "webhook.enabled=true", "--set", f"webhook.url=https://127.0.0.1:{port}",
        "--set", f"webhook.caBundle={ca}", "--show-only", "templates/webhook.yaml",
    ).stdout  # fmt: skip
    [configuration] = [doc for doc in yaml.safe_load_all(rendered) if doc]
    assert configuration["kind"] == "MutatingWebhookConfiguration"
    kubectl("apply", "-f", "-", input=yaml.safe_dump(configuration))
    kubectl("label", "namespace", unwatched_namespace, "rankwatch.io/inject=enabled")
    yield port, certs
    kubectl("delete", "mutatingwebhookconfiguration", configuration["metadata"]["name"], "--ignore-not-found")


@pytest.fixture
def chart_rbac_kubeconfig(helm, kubectl, kubeconfig, tmp_path) -> Any:
    """A kubeconfig holding a token of the chart's operator ServiceAccount, bound to the chart's RBAC as
    rendered with the webhook on (for namespaces rw-own-*): the operator below runs with exactly that."""
    release, namespace = f"kinds-rbac-{uuid.uuid4().hex[:6]}", "rankwatch-e2e-system"
    rendered = helm(
        "template", release, str(REPO / "helm" / "rankwatch"), "--namespace", namespace,
        "--set", "webhook.enabled=true", "--set", "operator.namespaces={rw-own-*}",
        "--show-only", "templates/serviceaccount.yaml", "--show-only", "templates/rbac.yaml",
    ).stdout  # fmt: skip
    kubectl("create", "namespace", namespace, check=False)
    kubectl("apply", "-f", "-", input=rendered)
    api = kubernetes.config.new_client_from_config(config_file=kubeconfig)
    token = (
        kubernetes.client.CoreV1Api(api)
        .create_namespaced_service_account_token(
            f"{release}-rankwatch", namespace, {"spec": {"expirationSeconds": 3600}}
        )
        .status.token
    )
    admin = yaml.safe_load(Path(kubeconfig).read_text())
    cluster = next(c for c in admin["clusters"])
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "operator",
        "clusters": [cluster],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": cluster["name"], "user": "operator"}}],
    }
    path = tmp_path / "operator-kubeconfig"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    yield str(path)
    kubectl("delete", "-f", "-", "--ignore-not-found", input=rendered)


def start_operator(processes, kubeconfig, namespace, log, port, certs, collector_port) -> subprocess.Popen:
    return processes.operator(
        kubeconfig, namespace, log, collector_port,
        {"RANKWATCH_WEBHOOK_LISTEN": f"127.0.0.1:{port}", "RANKWATCH_WEBHOOK_CERT_DIR": str(certs)},
    )  # fmt: skip


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(PATIENCE_S)


def injected(pod: kubernetes.client.V1Pod) -> bool:
    return any(c.name == "rankwatch-sidecar" for c in pod.spec.init_containers or [])


def probe_pod(namespace: str, job: str) -> dict[str, Any]:
    """An opted-in pod whose owner reference names an Indexed Job ``job`` that does not exist."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{job}-0",
            "namespace": namespace,
            "annotations": {"rankwatch.io/inject": "true", "batch.kubernetes.io/job-completion-index": "0"},
            "ownerReferences": [
                {"apiVersion": "batch/v1", "kind": "Job", "name": job, "uid": str(uuid.uuid4()), "controller": True}
            ],
        },
        "spec": {"containers": [{"name": "c", "image": "x"}]},
    }


def secrets_made_while(core: kubernetes.client.CoreV1Api, namespace: str, action: Any) -> list[str]:
    """The Secrets created in ``namespace`` while ``action`` ran (asserted truthy), seen in the order the
    API server made them: until a marker Secret made after it (the garbage collector may delete a
    Secret with a dangling owner before anyone lists it; the watch still saw it made)."""
    start = core.list_namespaced_secret(namespace).metadata.resource_version
    assert action()
    marker = f"marker-{uuid.uuid4().hex[:6]}"
    core.create_namespaced_secret(namespace, {"metadata": {"name": marker}})
    made = []
    for event in kubernetes.watch.Watch().stream(
        core.list_namespaced_secret, namespace, resource_version=start, timeout_seconds=PATIENCE_S
    ):
        name = event["object"].metadata.name
        if event["type"] == "ADDED" and name == marker:
            return made
        if event["type"] == "ADDED":
            made.append(name)
    raise AssertionError("the marker Secret was never seen")


def wait_for_webhook(kubectl, namespace: str, eventually) -> None:
    """Until the operator's webhook answers the API server: a server-side dry run of an opted-in pod of
    a (made-up) Indexed Job comes back injected."""
    probe = probe_pod(namespace, "probe")

    def answered() -> bool:
        result = kubectl(
            "create", "--dry-run=server", "-o", "yaml", "-f", "-", input=yaml.safe_dump(probe), check=False
        )
        return result.returncode == 0 and "rankwatch-sidecar" in result.stdout

    eventually(answered, PATIENCE_S, interval=0.5, what="the operator's webhook to answer")


class AlertSink:
    """A real HTTP server on loopback taking Alertmanager's webhook JSON (rankwatch's generic webhook
    receiver): what an incident bridge would receive."""

    def __init__(self) -> None:
        import http.server
        import json
        import threading

        received: list[dict[str, Any]] = []
        self.received = received

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                received.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def alerts(self, **labels: str) -> list[dict[str, Any]]:
        return [
            alert
            for message in self.received
            for alert in message.get("alerts", [])
            if all(alert.get("labels", {}).get(k) == v for k, v in labels.items())
        ]

    def stop(self) -> None:
        self.server.shutdown()


@pytest.fixture
def alert_sink(tmp_path) -> Any:
    sink = AlertSink()
    config = {
        "receivers": [{"name": "bridge", "webhook": {"url": sink.url}}],
        "route": {"receiver": "bridge", "group_wait": "1s", "group_interval": "5s", "repeat_interval": "4h"},
        "store": {"path": str(tmp_path / "alerts")},
    }
    (tmp_path / "alerting.yaml").write_text(yaml.safe_dump(config))
    sink.config = tmp_path / "alerting.yaml"
    yield sink
    sink.stop()


def standin_trainer(faults: dict[str, str], world_size: int) -> dict[str, Any]:
    """The stand-in trainer (4 ranks, TP 4 per pod) as a Job's container: its node rank is the pod's
    completion index, as a torchrun command line would take it from JOB_COMPLETION_INDEX."""
    env = [
        {"name": "NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX_FIELD}}},
        {"name": "NPROC_PER_NODE", "value": "4"},
        {"name": "WORLD_SIZE", "value": str(world_size)},
        {"name": "RANKWATCH_STANDIN_DEVICE", "value": "async"},
        *({"name": key, "value": value} for key, value in faults.items()),
    ]
    return {
        "name": "trainer",
        "image": "rankwatch/rankwatch:0.1.0",
        "command": ["rankwatch", "simulate-pod", "--tp", "4", "--pp", "1", "--steps", "1000000"],
        "env": env,
        "resources": {"limits": {"nvidia.com/gpu": 8}},  # a whole node each: one pod per node
    }


COMPLETION_INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


GROUP_ANNOTATIONS = {
    "rankwatch.io/inject": "true",
    "rankwatch.io/nproc-per-node": "4",
    "rankwatch.io/tensor-parallel": "4",
    "rankwatch.io/sensitivity-seconds": "10",
    "rankwatch.io/window-seconds": "2",
}


def standin_indexed_job(name: str, faults: dict[str, str]) -> dict[str, Any]:
    job = indexed_job(name, 2)
    template = job["spec"]["template"]
    template["metadata"]["annotations"] = dict(GROUP_ANNOTATIONS)
    template["spec"]["containers"] = [standin_trainer(faults, 8)]
    return job


def diagnosis_on(owner_annotations: dict[str, str] | None) -> dict[str, Any]:
    import json

    return json.loads((owner_annotations or {}).get("rankwatch.io/diagnosis") or "{}")


def node_state(core: kubernetes.client.CoreV1Api, name: str) -> tuple[bool, dict[str, str]]:
    node = core.read_node(name)
    marks = {k: v for k, v in (node.metadata.annotations or {}).items() if k.startswith("rankwatch.io/")}
    return bool(node.spec.unschedulable), marks


@contextlib.contextmanager
def group_operator(processes, operator_kubeconfig, kubeconfig, namespace, webhook, alert_sink, tmp_path):
    """The operator (webhook on, alerting to ``alert_sink``) and the pod runner for ``namespace``."""
    port, certs = webhook
    collector_port = processes.free_port()
    settings = {
        "RANKWATCH_WEBHOOK_LISTEN": f"127.0.0.1:{port}",
        "RANKWATCH_WEBHOOK_CERT_DIR": str(certs),
        "RANKWATCH_ALERTING_CONFIG": str(alert_sink.config),
        "POD_NAMESPACE": namespace,
        "RANKWATCH_CORDON_COOLDOWN_SECONDS": "0",
        "RANKWATCH_BREAKER_MAX_SHARE": "1",
    }
    operator = processes.operator(operator_kubeconfig, namespace, tmp_path / "operator.log", collector_port, settings)
    runner = processes.pod_runner(kubeconfig, f"http://127.0.0.1:{collector_port}", namespace, tmp_path / "pods")
    try:
        yield
    finally:
        processes.stop(runner)
        if operator.poll() is None:
            stop(operator)


def describe_cli(kubeconfig: str, namespace: str, reference: str) -> str:
    """`kubectl rankwatch describe` as a user runs it: kubectl finds the plugin (installed with rankwatch)
    on PATH."""
    import sys

    from rankwatch.cluster import binaries

    result = subprocess.run(
        [str(binaries.binary_path("kubectl")), "rankwatch", "describe", reference, "-n", namespace],
        capture_output=True,
        text=True,
        env={**os.environ, "KUBECONFIG": kubeconfig, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def assert_straggler_handled(
    api, namespace, read_owner, kind: str, name: str, uid: str, alert_sink, eventually, alert_kind: str = ""
):
    """Rank 5 (pod of node rank 1) made slow: the owner carries the diagnosis, its Event and its report;
    the node of that pod, and only it, is cordoned for the owner; the alert is sent (label ``jobkind``:
    ``alert_kind``, by default ``kind``). Returns the node."""
    core = kubernetes.client.CoreV1Api(api)

    def diagnosed() -> Any:
        owner = read_owner()
        record = diagnosis_on(owner["metadata"].get("annotations"))
        return record.get("active") and (owner, record)

    owner, record = eventually(diagnosed, PATIENCE_S, interval=1, what=f"the {kind}'s diagnosis annotation")
    assert record["kind"] == "Straggler" and record["ranks"] == [5], record
    [pod_name] = record["pods"]
    pod = core.read_namespaced_pod(pod_name, namespace)
    node = pod.spec.node_name
    assert record["nodes"] == [node]
    annotations = owner["metadata"]["annotations"]
    assert annotations["rankwatch.io/suspect-nodes"] == node and annotations["rankwatch.io/suspect-ranks"] == "5"
    assert annotations["rankwatch.io/health"] == "Degraded"
    report = core.read_namespaced_config_map(record["report"], namespace)
    assert [o.uid for o in report.metadata.owner_references] == [uid], f"deleted with the {kind}"
    assert "rank 5" in report.data["report.txt"]

    def owner_events(reason: str) -> list[Any]:
        items = core.list_namespaced_event(namespace, field_selector=f"reason={reason}").items
        return [e for e in items if e.involved_object.uid == uid]

    [event] = eventually(lambda: owner_events("Straggler"), PATIENCE_S, what=f"the Straggler Event on the {kind}")
    assert event.type == "Warning" and event.involved_object.kind == kind and "rank 5" in event.message
    assert record["report"] in event.message, "the Event says where the full report is"

    done = eventually(
        lambda: (r := diagnosis_on(read_owner()["metadata"].get("annotations"))).get("remediation")
        and r.get("alertedTime") and r,
        PATIENCE_S,
        interval=1,
        what=f"the cordon and the alert recorded on the {kind}",
    )  # fmt: skip
    assert done["remediation"] == f"cordoned and tainted {node}"
    unschedulable, marks = node_state(core, node)
    assert unschedulable and marks["rankwatch.io/cordon-job"] == f"{namespace}/{name}"
    assert marks["rankwatch.io/cordon-job-uid"] == uid
    others = [n.metadata.name for n in core.list_node().items if n.metadata.name != node]
    assert not [n for n in others if node_state(core, n)[0] or "rankwatch.io/cordon-job" in node_state(core, n)[1]]
    [cordoned] = eventually(lambda: owner_events("NodeCordoned"), PATIENCE_S, what="the NodeCordoned Event")
    assert f"{kind} {namespace}/{name}" in cordoned.message

    [alert] = eventually(
        lambda: alert_sink.alerts(jobkind=alert_kind or kind, trainingjob=name, namespace=namespace),
        PATIENCE_S,
        what="the alert at the webhook receiver",
    )
    assert alert["labels"]["alertname"] == "TrainingJobStraggler" and alert["labels"]["node"] == node
    assert alert["status"] == "firing"
    return node


def assert_no_refused_call(log: Path) -> None:
    """The operator (as the chart's ServiceAccount) was refused nothing: the chart grants what it calls."""
    refused = re.compile(r"\b(HTTP )?403\b(?!\])|[Ff]orbidden")  # not a timestamp that holds 403 ms
    calls = [line for line in log.read_text().splitlines() if refused.search(line.split("] ", 1)[-1])]
    assert not calls, calls[:5]


def assert_hang_handled(api, namespace, read_owner, kind: str, name: str, uid: str, alert_sink, eventually) -> str:
    """Rank 2 never calls: the owner carries the Hang diagnosis, its cordon and its alert; the Hang Event
    is on the owner alone. Returns the node."""
    core = kubernetes.client.CoreV1Api(api)

    def hung() -> dict[str, Any]:
        record = diagnosis_on(read_owner()["metadata"].get("annotations"))
        return record.get("active") and record.get("alertedTime") and record.get("remediation") and record

    record = eventually(hung, PATIENCE_S, interval=1, what=f"the {kind}'s Hang diagnosis, cordon and alert")
    assert record["kind"] == "Hang" and record["ranks"] == [2], record
    [pod_name] = record["pods"]
    node = core.read_namespaced_pod(pod_name, namespace).spec.node_name
    assert record["nodes"] == [node] and record["remediation"] == f"cordoned and tainted {node}"
    events = core.list_namespaced_event(namespace, field_selector="reason=Hang").items
    assert [e.involved_object.kind for e in events if e.involved_object.uid == uid] == [kind]
    [alert] = eventually(
        lambda: alert_sink.alerts(jobkind=kind, trainingjob=name, alertname="TrainingJobHang"),
        PATIENCE_S,
        what="the hang's alert",
    )
    assert alert["labels"]["node"] == node
    return node


@pytest.fixture
def watching(webhook, chart_rbac_kubeconfig, kubeconfig, processes, api, kubectl, unwatched_namespace, eventually,
             alert_sink, tmp_path):  # fmt: skip
    """``with watching(job):`` the operator (webhook on, as the chart's ServiceAccount) watches the test's
    namespace, its webhook answering; afterwards the nodes rankwatch cordoned for ``job`` are uncordoned
    (the tests share four nodes)."""
    from rankwatch.operator.remediation.cordon import uncordon_job

    @contextlib.contextmanager
    def watch(job: str) -> Iterator[None]:
        namespace = unwatched_namespace
        try:
            with group_operator(processes, chart_rbac_kubeconfig, kubeconfig, namespace, webhook, alert_sink, tmp_path):
                wait_for_webhook(kubectl, namespace, eventually)
                yield
        finally:
            uncordon_job(api, namespace, job, via="test")

    return watch


JOBSET_API = ("jobset.x-k8s.io", "v1alpha2", "jobsets")


@pytest.fixture
def jobset_controller(kubeconfig, unwatched_namespace, tmp_path):
    """The real JobSet controller (built from its Go module), its webhooks for this test's namespace."""
    from rankwatch.cluster.jobset import JobSetController

    controller = JobSetController(kubeconfig, unwatched_namespace, tmp_path / "jobset")
    controller.start(PATIENCE_S)
    yield controller
    controller.stop()


def standin_jobset(name: str, faults: dict[str, str]) -> dict[str, Any]:
    """A JobSet of 2 single-pod Jobs opted in, as a user writes it: node rank = the Job's global index."""
    trainer = standin_trainer(faults, 8)
    trainer["env"][0] = {
        "name": "NODE_RANK",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-global-index']"}},
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": {
            "replicatedJobs": [
                {
                    "name": "workers",
                    "replicas": 2,
                    "template": {
                        "spec": {
                            "parallelism": 1,
                            "completions": 1,
                            "backoffLimit": 0,
                            "template": {
                                "metadata": {"annotations": dict(GROUP_ANNOTATIONS)},
                                "spec": {"restartPolicy": "Never", "containers": [trainer]},
                            },
                        }
                    },
                }
            ]
        },
    }


VOLCANO_API = ("batch.volcano.sh", "v1alpha1", "jobs")


@pytest.fixture
def volcano_crd(kubectl, api, eventually):
    """Volcano's own Job CRD (from its Go module); its controller does not run here (it needs Volcano's
    scheduler, queues and PodGroups), so the test makes the pods as the controller would."""
    from rankwatch.cluster.jobset import volcano_job_crd

    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(volcano_job_crd()))
    eventually(lambda: crd_established(api, "jobs.batch.volcano.sh"), PATIENCE_S, what="Volcano's Job CRD established")


def volcano_job(name: str, faults: dict[str, str]) -> dict[str, Any]:
    """A Volcano Job of 2 workers opted in, as a user writes it (its node rank: the task index)."""
    trainer = standin_trainer(faults, 8)
    trainer["env"][0] = {
        "name": "NODE_RANK",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['volcano.sh/task-index']"}},
    }
    template = {"metadata": {"annotations": dict(GROUP_ANNOTATIONS)}, "spec": {"restartPolicy": "Never",
                "containers": [trainer]}}  # fmt: skip
    return {
        "apiVersion": "batch.volcano.sh/v1alpha1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "minAvailable": 2,
            "queue": "default",
            "tasks": [{"name": "worker", "replicas": 2, "template": template}],
        },
    }


def volcano_pod(job: dict[str, Any], index: int) -> dict[str, Any]:
    """The pod Volcano's job controller makes for task ``worker``, index ``index`` (createJobPod, v1.10)."""
    task = job["spec"]["tasks"][0]
    metadata = job["metadata"]
    annotations = {
        **task["template"]["metadata"]["annotations"],
        "volcano.sh/task-index": str(index),
        "volcano.sh/task-spec": task["name"],
        "scheduling.k8s.io/group-name": f"{metadata['name']}-{metadata['uid']}",
        "volcano.sh/job-name": metadata["name"],
        "volcano.sh/queue-name": "default",
        "volcano.sh/job-version": "0",
        "volcano.sh/template-uid": f"{metadata['name']}-{task['name']}",
        "volcano.sh/job-retry-count": "0",
    }
    labels = {
        "volcano.sh/task-index": str(index),
        "volcano.sh/job-name": metadata["name"],
        "volcano.sh/task-spec": task["name"],
        "volcano.sh/job-namespace": metadata["namespace"],
        "volcano.sh/queue-name": "default",
    }
    owner = {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "name": metadata["name"],
             "uid": metadata["uid"], "controller": True, "blockOwnerDeletion": True}  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{metadata['name']}-{task['name']}-{index}",
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [owner],
        },
        "spec": task["template"]["spec"],
    }


HANG_IN_FIRST_ATTEMPT = {
    "RANKWATCH_STANDIN_FAULT_RANK": "2",
    "RANKWATCH_STANDIN_HANG_BEFORE_CALL": "300",
    "RANKWATCH_STANDIN_FAULT_ATTEMPT": "0",  # the restarted group runs clean
}


def settled_restart(read_owner) -> dict[str, Any] | None:
    """The owner's diagnosis once its restart is decided (not merely claimed), else None."""
    record = diagnosis_on(read_owner()["metadata"].get("annotations"))
    outcome = record.get("restart") or ""
    return record if outcome and not outcome.startswith("pending") else None


def resumed_pods(read_owner, list_pods, first: set[str], count: int) -> list[Any]:
    """Once the owner rankwatch suspended to restart it is resumed (no ``spec.suspend``, no mark): its
    ``count`` new pods (uids not in ``first``) when all of them run, else an empty list."""
    owner = read_owner()
    if owner["spec"].get("suspend") or "rankwatch.io/restart-suspended" in owner["metadata"].get("annotations", {}):
        return []
    now = [p for p in list_pods() if p.metadata.uid not in first and not p.metadata.deletion_timestamp]
    return now if len(now) == count and all(p.status.phase == "Running" for p in now) else []


def second_look(api, group, read_owner) -> None:
    """The restart step run again on the diagnosis the owner carries: it pulls nothing."""
    from rankwatch.operator.kinds.group_record import GroupRecord
    from rankwatch.operator.kinds.registry import adapter_of_kind
    from rankwatch.operator.kinds.restart import restart_once
    from rankwatch.operator.spec import Remediation, TrainingJobSpec

    before = diagnosis_on(read_owner()["metadata"].get("annotations"))
    record = GroupRecord(api, adapter_of_kind(group.kind_key), group, Remediation())
    assert restart_once(record, TrainingJobSpec(template={})) is None
    assert diagnosis_on(read_owner()["metadata"].get("annotations")) == before


def owner_events(api, namespace: str, uid: str, reason: str) -> list[Any]:
    items = kubernetes.client.CoreV1Api(api).list_namespaced_event(namespace, field_selector=f"reason={reason}").items
    return [e for e in items if e.involved_object.uid == uid]


@pytest.fixture
def volcano_commands(kubectl, volcano_crd):
    """Volcano's Command CRD (bus.volcano.sh), from the same module as its Job CRD."""
    from rankwatch.cluster.jobset import volcano_job_crd

    crd = volcano_job_crd().parent / "bus.volcano.sh_commands.yaml"
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    kubectl("wait", "--for=condition=Established", "crd/commands.bus.volcano.sh", "--timeout=120s")
