"""Jobs of other kinds on the local cluster: the real operator serves the admission webhook on
loopback (the local API server runs on this host and calls it), registered with the chart's own
MutatingWebhookConfiguration; the real Job controller makes an Indexed Job's pods."""

from __future__ import annotations

import base64
import re
import signal
import subprocess
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from rankwatch.cluster import pki

pytestmark = pytest.mark.e2e

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


def test_indexed_job_pods_are_injected_and_pods_made_while_the_operator_is_down_start_and_are_reported(
    webhook, chart_rbac_kubeconfig, processes, api, kubectl, unwatched_namespace, eventually, tmp_path
):
    port, certs = webhook
    namespace = unwatched_namespace
    core, batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
    log = tmp_path / "operator.log"
    collector_port = processes.free_port()

    def pods(job: str) -> list[kubernetes.client.V1Pod]:
        return core.list_namespaced_pod(namespace, label_selector=f"batch.kubernetes.io/job-name={job}").items

    operator = start_operator(processes, chart_rbac_kubeconfig, namespace, log, port, certs, collector_port)
    try:
        wait_for_webhook(kubectl, namespace, eventually)
        watched = batch.create_namespaced_job(namespace, indexed_job("watched", 2))
        both = eventually(lambda: len(pods("watched")) == 2 and pods("watched"), PATIENCE_S, what="the Job's 2 pods")
        for pod in both:
            assert injected(pod), f"{pod.metadata.name} was not injected"
            assert pod.metadata.annotations["rankwatch.io/tracing"] == "enabled"
            assert pod.metadata.labels["rankwatch.io/traced"] == "true", "the NetworkPolicies' peer"
            sidecar = next(c for c in pod.spec.init_containers if c.name == "rankwatch-sidecar")
            env = {e.name: e for e in sidecar.env}
            assert env["RANKWATCH_JOB_NAME"].value == "watched" and env["RANKWATCH_NPROC_PER_NODE"].value == "2"
            index = env["RANKWATCH_REPLICA_INDEX"].value_from.field_ref.field_path
            assert index == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
            trainer = {e.name: e.value for e in pod.spec.containers[0].env}
            assert trainer["LD_PRELOAD"] == "/rankwatch/lib/librankwatch-nccl.so"
            assert "JOB_COMPLETION_INDEX" in trainer, "the Job controller's env is kept"
        secret = core.read_namespaced_secret("watched-rankwatch-job-token", namespace)
        assert [owner.uid for owner in secret.metadata.owner_references] == [watched.metadata.uid]
        assert secret.data["token"], "the group's sidecars have a token"
        eventually(
            lambda: all(p.status.phase == "Running" for p in pods("watched")),
            PATIENCE_S,
            what="the injected pods running",
        )

        # A dry run has no side effects (sideEffects: NoneOnDryRun): injected, but no token Secret made.
        held = indexed_job("held", 1)
        held["spec"]["suspend"] = True  # no pods of its own
        held = batch.create_namespaced_job(namespace, held)
        dry = probe_pod(namespace, "held")
        dry["metadata"]["ownerReferences"][0]["uid"] = held.metadata.uid
        answer = kubectl("create", "--dry-run=server", "-o", "yaml", "-f", "-", input=yaml.safe_dump(dry))
        assert "rankwatch-sidecar" in answer.stdout
        made = kubectl("get", "secret", "-n", namespace, "held-rankwatch-job-token", check=False)
        assert made.returncode != 0, "a Secret made by a dry run"

        # Owner references are whatever a pod's creator writes: no token Secret for a Job that does not exist.
        assert secrets_made_while(core, namespace, lambda: injected(
            core.create_namespaced_pod(namespace, probe_pod(namespace, "ghost"))
        )) == [], "a token Secret for a Job that does not exist"  # fmt: skip

        # A pod the webhook cannot inject is admitted as it is, says why, and its Job hears of it.
        refused = indexed_job("refused", 1)
        refused["spec"]["template"]["spec"]["containers"][0]["name"] = "rankwatch-sidecar"
        refused = batch.create_namespaced_job(namespace, refused)
        [pod] = eventually(lambda: pods("refused"), PATIENCE_S, what="the refused Job's pod")
        assert not injected(pod)
        why = f"Job {namespace}/refused: container name 'rankwatch-sidecar' is reserved for rankwatch"
        assert pod.metadata.annotations["rankwatch.io/not-injected"] == why

        def refused_reported() -> list[Any]:
            events = core.list_namespaced_event(namespace, field_selector="reason=Unwatched").items
            return [e for e in events if e.involved_object.uid == refused.metadata.uid and why in e.message]

        eventually(refused_reported, PATIENCE_S, what="the Unwatched Event on the refused Job, with the reason")

        stop(operator)
        # The webhook is gone: the API server gets no answer and, failing open, admits the pods as they are.
        unwatched = batch.create_namespaced_job(namespace, indexed_job("unwatched", 2))
        both = eventually(
            lambda: len(pods("unwatched")) == 2 and pods("unwatched"), PATIENCE_S, what="pods with no webhook"
        )
        assert not any(injected(pod) for pod in both)
        eventually(
            lambda: all(p.status.phase == "Running" for p in pods("unwatched")),
            PATIENCE_S,
            what="un-injected pods running",
        )
        names = sorted(pod.metadata.name for pod in both)

        operator = start_operator(processes, chart_rbac_kubeconfig, namespace, log, port, certs, collector_port)

        def reported() -> list[Any]:
            events = core.list_namespaced_event(namespace, field_selector="reason=Unwatched").items
            return [
                e
                for e in events
                if e.involved_object.uid == unwatched.metadata.uid and all(n in e.message for n in names)
            ]

        [event] = eventually(reported, PATIENCE_S, what="the Unwatched Event on the Job")
        assert event.type == "Warning" and event.involved_object.kind == "Job"
        assert event.message.startswith("2 of 2 opted-in pod(s)") and "operator was down" in event.message
        job = batch.read_namespaced_job("unwatched", namespace)
        assert job.metadata.annotations["rankwatch.io/unwatched-pods"] == "2"
        metrics = (
            urllib.request.urlopen(f"http://127.0.0.1:{collector_port}/metrics", timeout=PATIENCE_S).read().decode()
        )
        assert 'rankwatch_unwatched_pods{kind="Job"} 3.0' in metrics, "these two and the refused Job's pod"
        watched_events = core.list_namespaced_event(namespace, field_selector="reason=Unwatched").items
        assert not [e for e in watched_events if e.involved_object.uid == watched.metadata.uid], (
            "the injected Job is watched"
        )

        # Its pods gone (the Job suspended), the Job says so too.
        batch.patch_namespaced_job("unwatched", namespace, {"spec": {"suspend": True}})

        def annotation() -> str | None:
            return (batch.read_namespaced_job("unwatched", namespace).metadata.annotations or {}).get(
                "rankwatch.io/unwatched-pods"
            )

        eventually(lambda: annotation() is None, PATIENCE_S, what="the annotation gone with the unwatched pods")
        # an HTTP 403 or Forbidden, not a log line's timestamp that happens to hold 403 ms
        refused = re.compile(r"\b(HTTP )?403\b(?!\])|[Ff]orbidden")
        refused_calls = [line for line in log.read_text().splitlines() if refused.search(line.split("] ", 1)[-1])]
        assert not refused_calls, "the chart's RBAC lacks what the operator called"
    finally:
        if operator.poll() is None:
            stop(operator)
