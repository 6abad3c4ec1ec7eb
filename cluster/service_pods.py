"""What a kubelet and kube-proxy would do for rankwatch's own Deployment on the local cluster (the
chart's operator pods, label ``app.kubernetes.io/component=operator``), so that ``helm install`` runs
for real: the e2e tests kill the leader and watch the Services follow.

For every such pod bound to a node and Running, the runner
- starts its container's command (``rankwatch ...`` with this Python) with the container's env
  (fieldRefs resolved), ConfigMap and Secret volumes as directories, mount paths rewritten;
- gives the pod a network namespace of its own the only way a shared loopback allows: every
  ``containerPort`` is mapped to a free local port, and env values ``<host>:<containerPort>`` become
  ``127.0.0.1:<mapped>`` (the mapping is the pod annotation ``runner.rankwatch.io/ports``);
- runs it as its ServiceAccount: a token bound to the pod (TokenRequest), in a kubeconfig of its own
  (``$KUBECONFIG``), so the chart's RBAC is what the process has;
- restarts the container when it exits (``restartPolicy: Always``; ``restartCount`` counts it, the
  pid is the annotation ``runner.rankwatch.io/pid``);
- runs the readiness probe (``httpGet`` on the mapped port, its ``periodSeconds``) and writes the
  pod's ``Ready`` condition, from which the endpoint controller builds the Services' EndpointSlices.

:class:`ServiceProxy` is kube-proxy for one Service: a loopback port whose connections go to one of
the Service's ready endpoints (its pod's mapped port); with none ready it refuses them.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import yaml
from kubernetes.client.exceptions import ApiException

from rankwatch.cluster.ports import free_ports
from rankwatch.timestamps import rfc3339_now

OPERATOR_SELECTOR = "app.kubernetes.io/name=rankwatch,app.kubernetes.io/component=operator"
PORTS_ANNOTATION = "runner.rankwatch.io/ports"
PID_ANNOTATION = "runner.rankwatch.io/pid"
RESTART_BACKOFF_S = 10.0
"""The kubelet's first back-off before restarting a container that exited."""
LISTEN = re.compile(r"^(0\.0\.0\.0|127\.0\.0\.1|localhost|)?:(\d+)$")


@dataclass
class ServicePod:
    uid: str
    namespace: str
    name: str
    root: Path
    spec: dict[str, Any]
    ports: dict[int, int]  # containerPort -> local port
    named: dict[str, int]  # port name -> containerPort
    env: dict[str, str]
    argv: list[str]
    process: subprocess.Popen | None = None
    restarts: int = 0
    exited_at: float | None = None
    ready: bool | None = None
    next_probe: float = 0.0
    log: Any = None
    files: list[Any] = field(default_factory=list)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        for handle in self.files:
            handle.close()


class ServicePodRunner:
    def __init__(self, work_dir: Path, namespaces: list[str], api_client: kubernetes.client.ApiClient,
                 log: Any = print) -> None:  # fmt: skip
        self.work_dir, self.namespaces, self.log = work_dir, namespaces, log
        self.api = api_client
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.pods: dict[str, ServicePod] = {}
        self._lock = threading.Lock()

    def local_port(self, namespace: str, pod: str, container_port: int) -> int | None:
        with self._lock:
            for running in self.pods.values():
                if (running.namespace, running.name) == (namespace, pod):
                    return running.ports.get(container_port)
        return None

    def step(self) -> None:
        seen = set()
        for pod in self._list():
            metadata = pod["metadata"]
            uid = metadata["uid"]
            seen.add(uid)
            running = self.pods.get(uid)
            if metadata.get("deletionTimestamp"):
                if running:
                    self._remove(uid)
                continue
            if running is None:
                if (pod.get("status") or {}).get("phase") == "Running" and pod["spec"].get("nodeName"):
                    with self._lock:
                        self.pods[uid] = self._prepare(pod)
                continue
            self._follow(running)
        for uid in set(self.pods) - seen:
            self._remove(uid)

    def stop(self) -> None:
        for uid in list(self.pods):
            self._remove(uid)

    def _remove(self, uid: str) -> None:
        with self._lock:
            pod = self.pods.pop(uid)
        pod.kill()

    def _list(self) -> list[dict[str, Any]]:
        items = [
            pod
            for namespace in self.namespaces
            for pod in self.core.list_namespaced_pod(namespace, label_selector=OPERATOR_SELECTOR).items
        ]
        return [self.api.sanitize_for_serialization(pod) for pod in items]

    # -- a pod's container -------------------------------------------------------------------------
    def _prepare(self, pod: dict[str, Any]) -> ServicePod:
        metadata, spec = pod["metadata"], pod["spec"]
        namespace, name = metadata["namespace"], metadata["name"]
        root = self.work_dir / namespace / f"{name}-{metadata['uid'][:8]}"
        root.mkdir(parents=True, exist_ok=True)
        (container,) = spec["containers"]
        named = {p["name"]: p["containerPort"] for p in container.get("ports") or [] if p.get("name")}
        wanted = [p["containerPort"] for p in container.get("ports") or []]
        given = {port for pod in self.pods.values() for port in pod.ports.values()}
        ports = dict(zip(wanted, free_ports(len(wanted), avoid=given), strict=True))
        volumes = self._volumes(pod, root / "volumes")
        mounts = sorted(
            ((m["mountPath"].rstrip("/"), str(volumes[m["name"]])) for m in container.get("volumeMounts") or []),
            key=lambda mount: -len(mount[0]),
        )

        def local(text: str) -> str:
            for mount, path in mounts:  # longest first; a value is under at most one mount
                if text == mount or text.startswith(mount + "/"):
                    return path + text[len(mount) :]
            match = LISTEN.match(text)
            if match and int(match.group(2)) in ports:
                return f"127.0.0.1:{ports[int(match.group(2))]}"
            return text

        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(root), "PYTHONUNBUFFERED": "1", "TMPDIR": local("/tmp")}
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = local(str(item["value"]))
            elif "fieldRef" in (item.get("valueFrom") or {}):
                value: Any = pod
                for part in item["valueFrom"]["fieldRef"]["fieldPath"].split("."):
                    value = (value or {}).get(part)
                env[item["name"]] = "" if value is None else str(value)
        env["KUBECONFIG"] = str(self._service_account_kubeconfig(pod, root))
        argv = [local(part) for part in (container.get("command") or []) + (container.get("args") or [])]
        if argv and argv[0] == "rankwatch":
            argv = [sys.executable, "-m", "rankwatch", *argv[1:]]
        running = ServicePod(metadata["uid"], namespace, name, root, container, ports, named, env, argv)
        running.log = open(root / f"{container['name']}.log", "ab")  # noqa: SIM115 (closed with the pod)
        running.files.append(running.log)
        self._annotate(running, {PORTS_ANNOTATION: json.dumps({n: ports[p] for n, p in named.items()})})
        self._start(running)
        return running

    def _start(self, pod: ServicePod) -> None:
        pod.process = subprocess.Popen(pod.argv, env=pod.env, cwd=pod.root, stdout=pod.log, stderr=subprocess.STDOUT,
                                       start_new_session=True)  # fmt: skip
        pod.exited_at, pod.next_probe = None, time.monotonic()
        self._annotate(pod, {PID_ANNOTATION: str(pod.process.pid)})
        self.log(f"pod {pod.namespace}/{pod.name}: started {' '.join(pod.argv[3:5])} (pid {pod.process.pid})")

    def _follow(self, pod: ServicePod) -> None:
        now = time.monotonic()
        if pod.process is not None and pod.process.poll() is not None:
            if pod.exited_at is None:
                pod.exited_at = now
                self.log(f"pod {pod.namespace}/{pod.name}: exited with {pod.process.returncode}; restarting")
                self._set_ready(pod, False)
            if now - pod.exited_at >= RESTART_BACKOFF_S:
                pod.restarts += 1
                self._start(pod)
            return
        probe = pod.spec.get("readinessProbe") or {}
        if now < pod.next_probe or "httpGet" not in probe:
            return
        pod.next_probe = now + float(probe.get("periodSeconds", 10))
        get = probe["httpGet"]
        port = get["port"] if isinstance(get["port"], int) else pod.named.get(get["port"], 0)
        url = f"http://127.0.0.1:{pod.ports.get(port, 0)}{get.get('path', '/')}"
        try:
            with urllib.request.urlopen(url, timeout=float(probe.get("timeoutSeconds", 1))) as response:
                ready = 200 <= response.status < 400
        except OSError:
            ready = False
        self._set_ready(pod, ready)

    def _set_ready(self, pod: ServicePod, ready: bool) -> None:
        if pod.ready is ready:
            return
        pod.ready = ready
        stamp = rfc3339_now()
        status = "True" if ready else "False"
        body = {
            "status": {
                "conditions": [
                    {"type": "Ready", "status": status, "lastTransitionTime": stamp},
                    {"type": "ContainersReady", "status": status, "lastTransitionTime": stamp},
                ],
                "containerStatuses": [
                    {
                        "name": pod.spec["name"],
                        "image": pod.spec.get("image", ""),
                        "imageID": "",
                        "ready": ready,
                        "started": pod.exited_at is None,
                        "restartCount": pod.restarts,
                        "state": {"running": {"startedAt": stamp}},
                    }
                ],
            }
        }
        try:
            self.core.patch_namespaced_pod_status(pod.name, pod.namespace, body)
        except ApiException as error:
            if error.status != 404:
                raise

    def _annotate(self, pod: ServicePod, annotations: dict[str, str]) -> None:
        with contextlib.suppress(ApiException):
            self.core.patch_namespaced_pod(pod.name, pod.namespace, {"metadata": {"annotations": annotations}})

    def _volumes(self, pod: dict[str, Any], root: Path) -> dict[str, Path]:
        paths = {}
        namespace = pod["metadata"]["namespace"]
        for volume in pod["spec"].get("volumes") or []:
            path = root / volume["name"]
            path.mkdir(parents=True, exist_ok=True)
            if "configMap" in volume:
                configmap = self.core.read_namespaced_config_map(volume["configMap"]["name"], namespace)
                for key, value in (configmap.data or {}).items():
                    (path / key).write_text(value)
            elif "secret" in volume:
                secret = self.core.read_namespaced_secret(volume["secret"]["secretName"], namespace)
                for key, value in (secret.data or {}).items():
                    (path / key).write_bytes(base64.b64decode(value))
            paths[volume["name"]] = path
        return paths

    def _service_account_kubeconfig(self, pod: dict[str, Any], root: Path) -> Path:
        """A kubeconfig with a token of the pod's ServiceAccount, bound to the pod (gone with it)."""
        metadata = pod["metadata"]
        account = pod["spec"].get("serviceAccountName") or "default"
        request = {
            "spec": {
                "expirationSeconds": 7200,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": metadata["name"], "uid": metadata["uid"]},
            }
        }
        token = self.core.create_namespaced_service_account_token(account, metadata["namespace"], request).status.token
        configuration = self.api.configuration
        cluster: dict[str, Any] = {"server": configuration.host}
        if configuration.ssl_ca_cert:
            cluster["certificate-authority"] = configuration.ssl_ca_cert
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "cluster", "cluster": cluster}],
            "users": [{"name": account, "user": {"token": token}}],
            "contexts": [{"name": "pod", "context": {"cluster": "cluster", "user": account}}],
            "current-context": "pod",
        }
        path = root / "kubeconfig"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(yaml.safe_dump(config))
        return path


class ServiceProxy:
    """Loopback connections to one Service's port go to a ready endpoint, as kube-proxy would send them."""

    def __init__(self, pods: ServicePodRunner, namespace: str, service: str, log: Any = print) -> None:
        self.discovery = kubernetes.client.DiscoveryV1Api(pods.api)
        self.pods, self.namespace, self.service, self.log = pods, namespace, service, log
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._endpoints: tuple[float, list[tuple[str, int]]] = (0.0, [])
        self._turn = 0
        threading.Thread(target=self._accept, name=f"proxy {service}", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready_endpoints(self) -> list[tuple[str, int]]:
        """(pod name, container port) of each ready endpoint; refreshed at most every half second."""
        at, endpoints = self._endpoints
        if time.monotonic() - at < 0.5:
            return endpoints
        slices = self.discovery.list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"kubernetes.io/service-name={self.service}"
        )
        endpoints = []
        for item in slices.items:
            ports = [p.port for p in item.ports or []]
            for endpoint in item.endpoints or []:
                ref = endpoint.target_ref
                if endpoint.conditions and endpoint.conditions.ready and ref and ref.kind == "Pod" and ports:
                    endpoints.append((ref.name, ports[0]))
        self._endpoints = (time.monotonic(), endpoints)
        return endpoints

    def _accept(self) -> None:
        while True:
            client, _ = self._listener.accept()
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            endpoints = self.ready_endpoints()
        except Exception as error:  # API trouble: as if no endpoint
            self.log(f"proxy {self.service}: endpoints unreadable: {error}")
            endpoints = []
        target = None
        if endpoints:
            self._turn += 1
            pod, port = endpoints[self._turn % len(endpoints)]
            target = self.pods.local_port(self.namespace, pod, port)
        if target is None:
            client.close()  # no ready endpoint: refused, as kube-proxy rejects it
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", target), timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()
        _pump(client, upstream)


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
