"""`helm install` of the chart into the local cluster: the API server accepts every rendered object
(CRDs from crds/, RBAC, the peering object, Deployment, Services, ConfigMaps), and uninstall removes
them. kwok plays the kubelet, so the operator pods count as Running without pulling the image."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

REPO = Path(__file__).parents[2]
CHART = REPO / "helm" / "rankwatch"


@pytest.fixture(scope="module")
def helm(kubeconfig: str, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., subprocess.CompletedProcess[str]]:
    from rankwatch.cluster.binaries import ensure_tool

    path = ensure_tool("helm")
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        "KUBECONFIG": kubeconfig,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
        "HOME": str(home),
        "PATH": "/usr/bin:/bin",
    }

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([str(path), *args], env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stderr}{result.stdout}"
        return result

    return run


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
        "--set",
        f"operator.peering={name}",
        "--wait",
        "--timeout",
        "180s",
    )
    apps = kubernetes.client.AppsV1Api(api)
    deployment = apps.read_namespaced_deployment(f"{name}-rankwatch-operator", namespace)
    assert deployment.status.ready_replicas == 2
    core = kubernetes.client.CoreV1Api(api)
    services = {s.metadata.name for s in core.list_namespaced_service(namespace).items}
    assert services == {f"{name}-rankwatch-{s}" for s in ("collector", "intake", "metrics")}
    rbac = kubernetes.client.RbacAuthorizationV1Api(api)
    assert rbac.read_cluster_role(f"{name}-rankwatch-operator").rules
    objects = kubernetes.client.CustomObjectsApi(api)
    assert objects.get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", name)
    extensions = kubernetes.client.ApiextensionsV1Api(api)
    assert extensions.read_custom_resource_definition("clusterkopfpeerings.kopf.dev")
    # The server-side view of every rendered manifest: `helm get manifest` is what was applied.
    manifest = helm("get", "manifest", name, "--namespace", namespace).stdout
    assert "kind: Deployment" in manifest and "kind: ClusterRoleBinding" in manifest
