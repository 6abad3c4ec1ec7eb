"""`helm install` of the chart into the local cluster: the API server accepts every rendered object
(CRDs from crds/, RBAC, Deployment, Services, ConfigMaps), and uninstall removes them. kwok plays the
kubelet, so the operator pods count as Running without pulling the image; the tests that diagnose a
straggler run them for real with the pod runner, as test_failover.py does."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from operator_pods import Replicas, http, metric, start_pod_runner, tear_down_release
from trainingjobs import JOB_API, STRAGGLER, diagnosis_in, standin_job

pytestmark = pytest.mark.e2e

CHART = Path(__file__).parents[2] / "helm" / "rankwatch"


@pytest.fixture
def release(helm: Callable[..., Any], api: kubernetes.client.ApiClient, crd: None) -> Iterator[tuple[str, str]]:
    name, namespace = f"rw-{uuid.uuid4().hex[:6]}", f"rw-helm-{uuid.uuid4().hex[:6]}"
    yield name, namespace
    helm("uninstall", name, "--namespace", namespace, "--wait", "--timeout", "120s")
    kubernetes.client.CoreV1Api(api).delete_namespace(namespace)


def test_helm_install_is_accepted_by_the_api_server(helm, release, api, eventually):
    name, namespace = release
    helm(
        "install",
        name,
        str(CHART),
        "--namespace",
        namespace,
        "--create-namespace",
        "--wait",
        "--timeout",
        "180s",
    )
    apps = kubernetes.client.AppsV1Api(api)
    # the Deployment's status is the controller manager's to write, a moment after helm is done
    eventually(
        lambda: apps.read_namespaced_deployment(f"{name}-rankwatch-operator", namespace).status.replicas == 2,
        60,
        what="the Deployment's 2 replicas",
    )
    core = kubernetes.client.CoreV1Api(api)
    services = {s.metadata.name for s in core.list_namespaced_service(namespace).items}
    assert services == {f"{name}-rankwatch-{s}" for s in ("collector", "intake", "metrics")}
    rbac = kubernetes.client.RbacAuthorizationV1Api(api)
    assert rbac.read_cluster_role(f"{name}-rankwatch-operator").rules
    assert rbac.read_namespaced_role(f"{name}-rankwatch-operator", namespace).rules
    # The server-side view of every rendered manifest: `helm get manifest` is what was applied.
    manifest = helm("get", "manifest", name, "--namespace", namespace).stdout
    assert "kind: Deployment" in manifest and "kind: ClusterRoleBinding" in manifest


@pytest.fixture
def installed_without_secrets(helm, api, crd, kubeconfig, tmp_path) -> Iterator[Callable[..., tuple[Replicas, str]]]:
    """Install the chart with its default values but what the local cluster needs (the jobs'
    namespace, the pod runner's loopback sidecars, no cordon cooldown) and no Secret at all; its pods and the jobs' pods
    run for real by the pod runner. Yields ``install(*helm_args)``."""
    suffix = uuid.uuid4().hex[:6]
    release, namespace, jobs = f"nosec-{suffix}", f"rw-nosec-{suffix}", f"rw-nosecjobs-{suffix}"
    core = kubernetes.client.CoreV1Api(api)
    for name in (namespace, jobs):
        core.create_namespace({"metadata": {"name": name}})
    runner: subprocess.Popen | None = None

    def install(*args: str) -> tuple[Replicas, str]:
        nonlocal runner
        # Cooldown 0: earlier tests cordon and uncordon the same few nodes of the local cluster.
        values = {
            "operator": {
                "namespaces": [jobs],
                "sidecarEndpointHosts": ["127.0.0.1"],
                "safeguards": {"cordonCooldownSeconds": 0},
            }
        }
        (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
        helm("install", release, str(CHART), "--namespace", namespace, "--values", str(tmp_path / "values.yaml"),
             *args)  # fmt: skip
        runner = start_pod_runner(kubeconfig, namespace, release, jobs, tmp_path)
        return Replicas(api, namespace, release), jobs

    try:
        yield install
    finally:
        tear_down_release(helm, api, release, namespace, jobs, runner, tmp_path, cordoned_by=("slow",))


def diagnoses_a_straggler(replicas: Replicas, jobs: str, api, eventually) -> dict:
    """A job with one slow rank gets its straggler diagnosis and cordon from the installed operator."""
    objects = kubernetes.client.CustomObjectsApi(api)
    faults = STRAGGLER
    objects.create_namespaced_custom_object(
        *JOB_API[:2], jobs, JOB_API[2], standin_job("slow", faults, remediation={"cordon": True})
    )

    def diagnosed() -> dict | None:
        status = objects.get_namespaced_custom_object(*JOB_API[:2], jobs, JOB_API[2], "slow").get("status", {})
        diagnosis = diagnosis_in(status)
        return diagnosis if diagnosis.get("remediation") else None

    diagnosis = eventually(diagnosed, 240, interval=1, what="the straggler's diagnosis and cordon")
    assert diagnosis["kind"] == "Straggler" and diagnosis["active"]
    (node,) = diagnosis["nodes"]
    assert kubernetes.client.CoreV1Api(api).read_node(node).spec.unschedulable, "the suspect node is cordoned"
    return diagnosis


def leader(replicas: Replicas, eventually) -> dict:
    def leading() -> dict | None:
        pods = replicas.pods()
        holder = replicas.holder()
        return pods.get(holder) if holder in pods and replicas.ready(pods[holder]) else None

    return eventually(leading, 120, interval=0.5, what="a leading, ready operator")


def test_default_install_without_secrets_runs_an_operator_that_diagnoses(installed_without_secrets, api, eventually):
    replicas, jobs = installed_without_secrets()
    pod = leader(replicas, eventually)
    diagnoses_a_straggler(replicas, jobs, api, eventually)
    assert replicas.holder() in replicas.pods(), "the operator that diagnosed still runs"
    lines = eventually(lambda: metric_lines(pod), 30, what="the operator's /metrics")
    assert "rankwatch_alerting_ready" not in lines, "alerting is off: no readiness series"


def test_alerting_without_its_secrets_is_reported_and_the_operator_keeps_diagnosing(
    installed_without_secrets, api, eventually
):
    replicas, jobs = installed_without_secrets("--set", "alerting.enabled=true")
    pod = leader(replicas, eventually)
    holder = replicas.holder()
    assert eventually(lambda: "rankwatch_alerting_ready 0.0" in metric_lines(pod), 30, what="alerting_ready 0")
    core = kubernetes.client.CoreV1Api(api)

    def not_ready_event():
        return [
            e
            for e in core.list_namespaced_event(replicas.namespace).items
            if e.involved_object.kind == "Pod" and e.involved_object.name == holder and e.reason == "AlertingNotReady"
        ]

    (event,) = eventually(not_ready_event, 30, what="the AlertingNotReady Event on the leader's pod")
    assert event.type == "Warning"
    assert f"cannot read Secret {replicas.namespace}/rankwatch-feishu: HTTP 404" in event.message
    assert "diagnoses and cordons" in event.message
    diagnoses_a_straggler(replicas, jobs, api, eventually)
    assert replicas.holder() == holder, "no restart: the operator that reported it diagnosed"
    assert metric(pod, "rankwatch_alerting_ready") == 0


def metric_lines(pod: dict) -> str:
    """The operator's /metrics ("" until it answers): the chart serves them on a port of their own."""
    status, body = http(pod, "metrics", "/metrics")
    return body if status == 200 else ""
