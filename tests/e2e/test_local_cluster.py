"""The built-in local cluster: loopback only, RBAC on, GPU nodes, idempotent up, clean down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rankwatch.cluster import processes
from rankwatch.cluster.binaries import binary_path
from rankwatch.cluster.local import ORDER, LocalCluster

pytestmark = pytest.mark.e2e


def listening_addresses(pids: set[int]) -> list[str]:
    """Local addresses of the TCP sockets these processes listen on (from `ss`)."""
    output = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    addresses = []
    for line in output.splitlines():
        if any(f"pid={pid}," in line for pid in pids):
            addresses.append(line.split()[3])
    return addresses


@pytest.fixture
def own_cluster(tmp_path: Path):
    """A second, private cluster (its own state directory), always taken down."""
    cluster = LocalCluster(tmp_path / "cluster")
    yield cluster
    cluster.down(log=lambda _: None)


def test_two_node_cluster_up_resize_and_clean_down(own_cluster: LocalCluster, kubectl_path: str):
    state = own_cluster.up(nodes=2, log=lambda _: None)
    config = str(own_cluster.kubeconfig)
    assert oct(own_cluster.kubeconfig.stat().st_mode & 0o777) == "0o600", "the kubeconfig holds a private key"

    nodes = json.loads(
        subprocess.run(
            [kubectl_path, "--kubeconfig", config, "get", "nodes", "-o", "json"], capture_output=True, check=True
        ).stdout
    )["items"]
    assert sorted(node["metadata"]["name"] for node in nodes) == ["gpu-node-0", "gpu-node-1"]
    for node in nodes:
        assert node["status"]["capacity"]["nvidia.com/gpu"] == "8"
        assert node["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True"

    addresses = listening_addresses(set(state.pids.values()))
    assert addresses, "the components listen somewhere"
    assert all(address.startswith("127.0.0.1:") for address in addresses), addresses

    # Idempotent: a second `up` starts nothing and changes the node count when asked to.
    again = own_cluster.up(nodes=3, log=lambda _: None)
    assert again.pids == state.pids
    names = subprocess.run(
        [kubectl_path, "--kubeconfig", config, "get", "nodes", "-o", "name"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert sorted(names) == ["node/gpu-node-0", "node/gpu-node-1", "node/gpu-node-2"]

    own_cluster.down(log=lambda _: None)
    for name, pid in state.pids.items():
        assert not processes.is_running(pid, binary_path(name)), f"{name} survived `down`"
    leftovers = subprocess.run(["pgrep", "-f", str(own_cluster.root)], capture_output=True, text=True).stdout
    assert leftovers == "", f"orphan processes: {leftovers}"
    assert not own_cluster.root.exists()


def test_up_restarts_only_what_died_and_keeps_the_objects(own_cluster: LocalCluster, kubectl_path: str):
    state = own_cluster.up(nodes=1, log=lambda _: None)
    config = str(own_cluster.kubeconfig)
    kubectl = [kubectl_path, "--kubeconfig", config]
    subprocess.run([*kubectl, "create", "namespace", "survivor"], check=True, capture_output=True)

    os.killpg(state.pids["kwok"], signal.SIGKILL)
    os.killpg(state.pids["kube-apiserver"], signal.SIGKILL)
    assert own_cluster.status()["ready"] is False

    again = own_cluster.up(nodes=1, log=lambda _: None)
    assert again.pids["etcd"] == state.pids["etcd"]
    assert again.pids["kube-scheduler"] == state.pids["kube-scheduler"]
    assert again.pids["kwok"] != state.pids["kwok"]
    assert again.pids["kube-apiserver"] != state.pids["kube-apiserver"]
    assert own_cluster.status()["ready"] is True
    subprocess.run([*kubectl, "get", "namespace", "survivor"], check=True, capture_output=True)


def test_rbac_is_enforced_for_component_identities(own_cluster: LocalCluster, kubectl_path: str):
    own_cluster.up(nodes=1, log=lambda _: None)
    scheduler = own_cluster.root / "kubeconfigs" / "scheduler.kubeconfig"
    denied = subprocess.run(
        [kubectl_path, "--kubeconfig", str(scheduler), "get", "secrets", "-A"], capture_output=True, text=True
    )
    assert denied.returncode != 0
    assert 'User "system:kube-scheduler" cannot list resource "secrets"' in denied.stderr
    allowed = subprocess.run([kubectl_path, "--kubeconfig", str(scheduler), "get", "nodes"], capture_output=True)
    assert allowed.returncode == 0


def test_cli_status_and_kubeconfig(own_cluster: LocalCluster):
    env = {**os.environ, "RANKWATCH_CLUSTER_DIR": str(own_cluster.root)}
    cli = [sys.executable, "-m", "rankwatch", "cluster"]
    absent = subprocess.run([*cli, "status"], env=env, capture_output=True, text=True)
    assert absent.returncode == 1 and json.loads(absent.stdout)["exists"] is False

    up = subprocess.run([*cli, "up", "--nodes", "1"], env=env, capture_output=True, text=True)
    assert up.returncode == 0, up.stderr
    assert f"export KUBECONFIG={own_cluster.kubeconfig}" in up.stderr
    status = subprocess.run([*cli, "status"], env=env, capture_output=True, text=True)
    assert status.returncode == 0
    report = json.loads(status.stdout)
    assert report["ready"] is True and set(report["components"]) == set(ORDER)
    path = subprocess.run([*cli, "kubeconfig"], env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert path == str(own_cluster.kubeconfig)

    bad = subprocess.run([*cli, "up", "--nodes", "0"], env=env, capture_output=True, text=True)
    assert bad.returncode == 1 and "--nodes must be at least 1" in bad.stderr
