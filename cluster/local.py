"""A real Kubernetes control plane on loopback, without containers: `rankwatch cluster up|down|status`.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler run as local processes built from
their Go modules; kwok plays the kubelet of a pool of fake GPU nodes. Everything lives under one
state directory (``$RANKWATCH_CLUSTER_DIR``, default ``~/.rankwatch/cluster``): certificates, etcd
data, logs, per-component kubeconfigs, the admin kubeconfig and ``state.json`` (ports and pids).
``up`` is idempotent: running components are left alone, dead ones are restarted on the same ports
and data, so objects survive a restart of the machine's processes.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from rankwatch.cluster import binaries, kubeconfig, pki, processes
from rankwatch.cluster.binaries import Log
from rankwatch.cluster.kueue import LocalKueue
from rankwatch.cluster.monitoring import LocalMonitoring, MonitoringSettings
from rankwatch.cluster.nodes import KWOK_ANNOTATION, MANAGED_LABEL, fake_gpu_node, node_name
from rankwatch.cluster.state import (
    DEFAULT_NODES,
    ClusterError,
    ClusterState,
    cluster_dir,
    free_ports_by_name,
    port_free,
)

SERVICE_CIDR = "10.0.0.0/24"
POD_CIDR = "10.244.0.1/16"
ORDER = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
LISTENS_ON = {
    "etcd": ("etcd", "etcd-peer"),
    "kube-apiserver": ("kube-apiserver",),
    "kube-controller-manager": ("kube-controller-manager",),
    "kube-scheduler": ("kube-scheduler",),
    "kwok": ("kwok",),
}


class LocalCluster:
    """The cluster rooted at one state directory."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or cluster_dir()
        self.pki = self.root / "pki"
        self.logs = self.root / "logs"
        self.state_path = self.root / "state.json"
        self.kubeconfig = self.root / "kubeconfig"

    # ---- paths and addresses -------------------------------------------------------------
    def _component_kubeconfig(self, stem: str) -> Path:
        return self.root / "kubeconfigs" / f"{stem}.kubeconfig"

    def server(self, state: ClusterState) -> str:
        return f"https://127.0.0.1:{state.ports['kube-apiserver']}"

    def _argv(self, name: str, state: ClusterState, paths: dict[str, Path]) -> list[str]:
        port = state.ports
        etcd_url = f"https://127.0.0.1:{port['etcd']}"
        if name == "etcd":
            peer = f"http://127.0.0.1:{port['etcd-peer']}"  # one member: no peer ever connects
            return [
                str(paths["etcd"]),
                "--name=rankwatch",
                f"--data-dir={self.root / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=rankwatch={peer}",
                f"--cert-file={self.pki / 'etcd-server.crt'}",
                f"--key-file={self.pki / 'etcd-server.key'}",
                f"--trusted-ca-file={self.pki / 'ca.crt'}",
                "--client-cert-auth=true",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ]
        if name == "kube-apiserver":
            return [
                str(paths["kube-apiserver"]),
                f"--etcd-servers={etcd_url}",
                f"--etcd-cafile={self.pki / 'ca.crt'}",
                f"--etcd-certfile={self.pki / 'apiserver-etcd-client.crt'}",
                f"--etcd-keyfile={self.pki / 'apiserver-etcd-client.key'}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={port['kube-apiserver']}",
                f"--cert-dir={self.pki}",
                f"--tls-cert-file={self.pki / 'apiserver.crt'}",
                f"--tls-private-key-file={self.pki / 'apiserver.key'}",
                f"--client-ca-file={self.pki / 'ca.crt'}",
                # A front-proxy CA silences the scheduler's and controller-manager's retries; no
                # certificate carries the allowed name, so no one can use the header path.
                f"--requestheader-client-ca-file={self.pki / 'ca.crt'}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={self.pki / 'sa.pub'}",
                f"--service-account-signing-key-file={self.pki / 'sa.key'}",
                "--authorization-mode=Node,RBAC",
                "--allow-privileged=true",
                "--endpoint-reconciler-type=none",
                "--profiling=false",
            ]
        if name == "kube-controller-manager":
            config = self._component_kubeconfig("controller-manager")
            return [
                str(paths["kube-controller-manager"]),
                f"--kubeconfig={config}",
                f"--authentication-kubeconfig={config}",
                f"--authorization-kubeconfig={config}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port['kube-controller-manager']}",
                f"--root-ca-file={self.pki / 'ca.crt'}",
                f"--service-account-private-key-file={self.pki / 'sa.key'}",
                "--use-service-account-credentials=true",
                "--leader-elect=false",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--profiling=false",
            ]
        if name == "kube-scheduler":
            config = self._component_kubeconfig("scheduler")
            return [
                str(paths["kube-scheduler"]),
                f"--kubeconfig={config}",
                f"--authentication-kubeconfig={config}",
                f"--authorization-kubeconfig={config}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port['kube-scheduler']}",
                "--leader-elect=false",
                "--profiling=false",
            ]
        if name == "kwok":
            return [
                str(paths["kwok"]),
                f"--kubeconfig={self._component_kubeconfig('kwok')}",
                f"--config={Path(__file__).parent / 'kwok-stages.yaml'}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                f"--cidr={POD_CIDR}",
                "--node-ip=192.0.2.1",
                f"--server-address=127.0.0.1:{port['kwok']}",
                "--node-lease-duration-seconds=40",
            ]
        raise KeyError(name)

    # ---- lifecycle ---------------------------------------------------------------------------
    def up(
        self,
        nodes: int = DEFAULT_NODES,
        log: Log = print,
        timeout: float = 180.0,
        monitoring: MonitoringSettings | bool = False,
        kueue: bool = False,
    ) -> ClusterState:
        """Bring every component up (building binaries on first use); wait until usable. With
        ``monitoring`` also Prometheus and Alertmanager (``True``: the settings of the last time); with
        ``kueue`` also the Kueue controller and its CRDs and webhooks."""
        if nodes < 1:
            raise ClusterError(f"--nodes must be at least 1, got {nodes}")
        paths = binaries.ensure_all(log)
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)
        state = ClusterState.load(self.state_path)
        if state is None or not (self.pki / "ca.crt").exists():
            state = ClusterState(ports=free_ports_by_name(["etcd", "etcd-peer", *ORDER[1:]]))
            pki.generate(self.pki)
        state.nodes = nodes
        server = self.server(state)
        kubeconfig.write(self.kubeconfig, server, self.pki, "admin")
        for stem in ("controller-manager", "scheduler", "kwok"):
            kubeconfig.write(self._component_kubeconfig(stem), server, self.pki, stem)

        deadline = time.monotonic() + timeout
        started = {}
        for name in ORDER:
            if processes.is_running(state.pids.get(name), paths[name]):
                continue
            log(f"starting {name}")
            # A component killed a moment ago may still hold its port while it exits.
            for port_name in LISTENS_ON[name]:
                self.wait_until(
                    lambda p=state.ports[port_name]: port_free(p), f"port {state.ports[port_name]}", deadline
                )
            started[name] = processes.start(self._argv(name, state, paths), self.logs / f"{name}.log")
            state.pids[name] = started[name].pid
            state.save(self.state_path)  # recorded at once so `down` can always find it
            if name == "etcd":
                self.wait_until(lambda: _tcp_open(state.ports["etcd"]), "etcd", deadline)
            elif name == "kube-apiserver":
                self.wait_until(lambda: self._healthy(state, "/readyz"), "kube-apiserver", deadline)
        for name in ORDER:
            # A child started here is checked through its Popen: right after the exec, /proc/<pid>/cmdline
            # reads empty for a moment (the kernel fills it in after closing the exec pipe Popen waits on).
            if name in started:
                alive = started[name].poll() is None
            else:
                alive = processes.is_running(state.pids.get(name), paths[name])
            if not alive:
                how = f" with code {started[name].poll()}" if name in started else " since the last `up`"
                tail = processes.log_tail(self.logs / f"{name}.log")
                raise ClusterError(f"{name} exited{how}:\n{tail}")
        self._reconcile_nodes(state, nodes, log, deadline)
        self.wait_until(
            lambda: self.api_request(state, "GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200,
            "kube-controller-manager (default ServiceAccount)",
            deadline,
        )
        if monitoring:
            settings = monitoring if isinstance(monitoring, MonitoringSettings) else None
            try:
                LocalMonitoring(self).up(state, settings, log, deadline)
            finally:
                state.save(self.state_path)
        if kueue:
            try:
                LocalKueue(self).up(state, log, deadline)
            finally:
                state.save(self.state_path)
        log(f"cluster ready: {nodes} GPU nodes; export KUBECONFIG={self.kubeconfig}")
        return state

    def down(self, log: Log = print) -> None:
        """Stop every component (no orphans) and delete the state directory."""
        state = ClusterState.load(self.state_path)
        if state is not None:
            LocalMonitoring(self).stop(state, log)
            if "kueue" in state.pids:
                LocalKueue(self).stop(state, log)
            for name in reversed(ORDER):
                pid = state.pids.get(name)
                if pid:
                    processes.stop(pid, binaries.binary_path(name))
                    log(f"stopped {name}")
        if self.root.exists():
            shutil.rmtree(self.root)
        log("cluster removed")

    def restart_component(
        self,
        name: str,
        down_seconds: float = 0.0,
        log: Log = print,
        timeout: float = 120.0,
        grace_seconds: float = 10.0,
    ) -> float:
        """Stop one running component (SIGTERM, SIGKILL after ``grace_seconds``: 0 is a crash), keep it down
        ``down_seconds``, start it again on the same ports and data, and wait until the API server answers
        /readyz again; returns the seconds that took after the start. For failure tests: the API server or
        etcd going away under a running operator."""
        if name not in ORDER:
            raise ClusterError(f"unknown component {name!r}; one of {', '.join(ORDER)}")
        state = ClusterState.load(self.state_path)
        if state is None:
            raise ClusterError(f"no cluster in {self.root}; run `rankwatch cluster up`")
        paths = {component: binaries.binary_path(component) for component in ORDER}
        pid = state.pids.get(name)
        if not processes.is_running(pid, paths[name]):
            raise ClusterError(f"{name} is not running (pid {pid}); `rankwatch cluster up` starts it")
        log(f"stopping {name}")
        processes.stop(pid, paths[name], grace_seconds)
        time.sleep(down_seconds)
        deadline = time.monotonic() + timeout
        for port_name in LISTENS_ON[name]:
            self.wait_until(lambda p=state.ports[port_name]: port_free(p), f"port {state.ports[port_name]}", deadline)
        log(f"starting {name}")
        started = time.monotonic()
        state.pids[name] = processes.start(self._argv(name, state, paths), self.logs / f"{name}.log").pid
        state.save(self.state_path)
        self.wait_until(
            lambda: self._healthy(state, "/readyz"), f"kube-apiserver ready after restarting {name}", deadline
        )
        return time.monotonic() - started

    def status(self) -> dict[str, object]:
        """Which components run, whether the API answers, and the node count."""
        state = ClusterState.load(self.state_path)
        if state is None:
            return {"exists": False, "components": {}, "ready": False}
        components = {name: processes.is_running(state.pids.get(name), binaries.binary_path(name)) for name in ORDER}
        ready = components["kube-apiserver"] and self._healthy(state, "/readyz")
        components.update(LocalMonitoring(self).status(state))
        if "kueue" in state.pids:  # started by `up --kueue` and not stopped since
            components["kueue"] = LocalKueue(self).running(state)
        status: dict[str, object] = {
            "exists": True,
            "components": components,
            "ready": bool(ready and all(components.values())),
            "server": self.server(state),
            "kubeconfig": str(self.kubeconfig),
            "nodes": state.nodes,
        }
        if "prometheus" in state.ports:
            status["prometheus"] = f"http://127.0.0.1:{state.ports['prometheus']}"
            status["alertmanager"] = f"http://127.0.0.1:{state.ports['alertmanager']}"
        return status

    # ---- readiness ---------------------------------------------------------------------------
    def _ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        context.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return context

    def api_request(self, state: ClusterState, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        request = urllib.request.Request(
            self.server(state) + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, context=self._ssl_context(), timeout=5) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def _healthy(self, state: ClusterState, path: str) -> bool:
        try:
            return self.api_request(state, "GET", path)[0] == 200
        except (OSError, ssl.SSLError):
            return False

    def _reconcile_nodes(self, state: ClusterState, count: int, log: Log, deadline: float) -> None:
        status, body = self.api_request(state, "GET", f"/api/v1/nodes?labelSelector={MANAGED_LABEL}%3Dtrue")
        if status != 200:
            raise ClusterError(f"listing nodes failed: HTTP {status}: {body[:300]!r}")
        existing = {item["metadata"]["name"] for item in json.loads(body)["items"]}
        wanted = {node_name(index) for index in range(count)}
        for index in range(count):
            if node_name(index) not in existing:
                status, body = self.api_request(state, "POST", "/api/v1/nodes", fake_gpu_node(index))
                if status not in (201, 409):
                    raise ClusterError(f"creating node {node_name(index)} failed: HTTP {status}: {body[:300]!r}")
        for name in sorted(existing - wanted):
            self.api_request(state, "DELETE", f"/api/v1/nodes/{name}")
            log(f"removed node {name}")

        def all_ready() -> bool:
            status, body = self.api_request(state, "GET", f"/api/v1/nodes?labelSelector={MANAGED_LABEL}%3Dtrue")
            ready = [
                item
                for item in json.loads(body)["items"]
                if any(
                    c["type"] == "Ready" and c["status"] == "True" for c in item.get("status", {}).get("conditions", [])
                )
            ]
            return status == 200 and len(ready) == count

        self.wait_until(all_ready, f"{count} kwok nodes Ready", deadline)

    def wait_until(self, condition: Callable[[], bool], what: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(0.25)
        tails = "\n".join(
            f"--- {name} log (last lines) ---\n{processes.log_tail(self.logs / f'{name}.log', 8)}" for name in ORDER
        )
        raise ClusterError(f"timed out waiting for {what}\n{tails}")


def _tcp_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0
