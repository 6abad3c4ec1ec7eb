"""`helm install` of the chart into the local cluster: the API server accepts every rendered object
(CRDs from crds/, RBAC, Deployment, Services, ConfigMaps), and uninstall removes them. kwok plays the
kubelet, so the operator pods count as Running without pulling the image (test_failover.py runs them)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

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
