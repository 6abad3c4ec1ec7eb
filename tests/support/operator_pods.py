"""The chart's operator pods as the pod runner runs them: which replica leads, their endpoints, and
what their ports answer (health, /metrics)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import kubernetes


class Replicas:
    """The operator pods of the release as the pod runner runs them."""

    def __init__(self, api: kubernetes.client.ApiClient, namespace: str, release: str) -> None:
        self.core = kubernetes.client.CoreV1Api(api)
        self.discovery = kubernetes.client.DiscoveryV1Api(api)
        self.coordination = kubernetes.client.CoordinationV1Api(api)
        self.namespace, self.release = namespace, release

    def pods(self) -> dict[str, dict[str, Any]]:
        """Running operator pods by name: their local ports and the pid of their process."""
        pods = self.core.list_namespaced_pod(self.namespace, label_selector="app.kubernetes.io/component=operator")
        found = {}
        for pod in pods.items:
            annotations = pod.metadata.annotations or {}
            if "runner.rankwatch.io/pid" in annotations and not pod.metadata.deletion_timestamp:
                found[pod.metadata.name] = {
                    "ports": json.loads(annotations["runner.rankwatch.io/ports"]),
                    "pid": int(annotations["runner.rankwatch.io/pid"]),
                }
        return found

    def holder(self) -> str:
        """The pod whose process holds the Lease (identities are ``<pod>_<random>``)."""
        try:
            lease = self.coordination.read_namespaced_lease(f"{self.release}-rankwatch-operator", self.namespace)
        except kubernetes.client.exceptions.ApiException as error:
            if error.status == 404:
                return ""  # nobody took it yet
            raise
        return (lease.spec.holder_identity or "").rsplit("_", 1)[0]

    def ready(self, pod: dict[str, Any]) -> bool:
        return http(pod, "health", "/readyz")[0] == 200

    def endpoints(self, service: str) -> list[str]:
        """The ready endpoints of one of the release's Services (what kube-proxy routes to)."""
        slices = self.discovery.list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"kubernetes.io/service-name={self.release}-rankwatch-{service}"
        )
        return sorted(
            e.target_ref.name
            for s in slices.items
            for e in s.endpoints or []
            if e.conditions and e.conditions.ready and e.target_ref
        )


def http(pod: dict[str, Any], port: str, path: str) -> tuple[int | None, str]:
    """(status, body) of a GET to one replica; (None, why) when nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{pod['ports'][port]}{path}", timeout=2) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError as error:
        return None, str(error)


def refuses(pod: dict[str, Any], port: str) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex(("127.0.0.1", pod["ports"][port])) != 0


def metric(pod: dict[str, Any], name: str) -> float:
    status, body = http(pod, "metrics", "/metrics")  # the chart serves /metrics on a port of its own
    if status != 200:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name))


def start_pod_runner(kubeconfig: str, namespace: str, release: str, jobs: str, work: Path) -> subprocess.Popen:
    """The pod runner for the release's pods and the jobs' pods, logging to ``work/pod-runner.log``."""
    with open(work / "pod-runner.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "rankwatch", "cluster", "run-pods", "--collector-service",
             f"{namespace}/{release}-rankwatch-collector", "-n", namespace, "-n", jobs, "--work-dir",
             str(work / "pods")],
            env={**os.environ, "KUBECONFIG": kubeconfig}, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip


def tear_down_release(
    helm: Callable[..., Any],
    api: kubernetes.client.ApiClient,
    release: str,
    namespace: str,
    jobs: str,
    runner: subprocess.Popen | None,
    work: Path,
    cordoned_by: Iterable[str] = (),
) -> None:
    """Undo what an installed release left: the nodes its jobs ``cordoned_by`` cordoned, the pod runner,
    the release, both namespaces; then print the operator pods' log tails for a failed test to show."""
    from rankwatch.operator.remediation.cordon import uncordon_job

    for job in cordoned_by:
        uncordon_job(api, jobs, job, via="test")
    if runner is not None:
        runner.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            runner.wait(20)
        if runner.poll() is None:
            runner.kill()
    helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s")
    core = kubernetes.client.CoreV1Api(api)
    for name in (jobs, namespace):
        core.delete_namespace(name)
    for log in sorted((work / "pods" / namespace).glob("*/operator.log")):
        print(f"--- {log.parent.name}\n{log.read_text()[-4000:]}")
