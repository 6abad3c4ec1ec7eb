"""The real Kueue controller beside the local control plane: `rankwatch cluster up --kueue`.

Kueue (sigs.k8s.io/kueue) admits workloads whole against ClusterQueue quotas; rankwatch's worker pods
join it as one *pod group* (``rankwatch.operator.lifecycle.gang``). Here its manager runs as a local
process built from its Go module (cluster/gomod/kueue), as in a cluster, with:

- its CustomResourceDefinitions, read from the pinned module's ``config/components/crd/bases``;
- its admission webhooks (the pod webhook gates every queued pod until its group is admitted) served
  on a loopback port with a certificate of our CA: the kube-apiserver runs on this host, so a
  ``clientConfig.url`` of ``https://127.0.0.1:<port>`` reaches it. Only the webhooks of the pod
  integration and of Kueue's own resources are registered: the other integrations are not enabled;
- its internal certificate management off (it would issue a certificate for an in-cluster Service
  name the API server cannot reach from here). Kueue v0.17 then reads its metrics certificate from a
  fixed path, ``/etc/kueue/metrics/certs`` (cmd/kueue/main.go); one for loopback is written there when
  absent. Nothing here scrapes Kueue's metrics (its metrics server is off).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from rankwatch.cluster import binaries, pki, processes
from rankwatch.cluster.binaries import Log
from rankwatch.cluster.state import ClusterState, free_ports_by_name
from rankwatch.cluster.versions import KUEUE, KUEUE_VERSION

if TYPE_CHECKING:
    from rankwatch.cluster.local import LocalCluster

NAME = "kueue"
NAMESPACE = "kueue-system"
PORTS = ("kueue-webhook", "kueue-health")
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")
"""Where Kueue v0.17 reads its metrics serving certificate when its internal cert management is off."""
WEBHOOK_CONFIGURATIONS = {
    "MutatingWebhookConfiguration": "rankwatch-local-kueue-mutating",
    "ValidatingWebhookConfiguration": "rankwatch-local-kueue-validating",
}
MANAGED_LABEL = "kueue.x-k8s.io/managed"
"""Kueue's pod webhook labels the pods it manages ``true`` and gives them its finalizer."""
FINALIZER_PREFIX = "kueue.x-k8s.io/"
SYSTEM_NAMESPACES = ["kube-system", NAMESPACE]
"""Kueue's own deployment keeps its pod webhooks out of these (its kustomization's namespaceSelector)."""


class KueueError(RuntimeError):
    """Kueue could not be installed or started; the message says why."""


def module_dir() -> Path:
    """The pinned Kueue module's source (CRDs, webhook manifests), from the Go module cache."""
    result = subprocess.run(
        ["go", "mod", "download", "-json", f"sigs.k8s.io/kueue@{KUEUE_VERSION}"],
        cwd=KUEUE.module_dir,
        env={**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=readonly"},
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise KueueError(
            f"cannot find sigs.k8s.io/kueue@{KUEUE_VERSION} in the Go module cache: {result.stderr[-500:]}"
        )
    return Path(json.loads(result.stdout)["Dir"])


def _served_webhooks(manifests: Path, url: str, ca_bundle: str) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, cut to the pod integration and Kueue's own resources, pointed at
    ``url`` (its webhook server on loopback)."""
    configurations = []
    for document in yaml.safe_load_all(manifests.read_text()):
        if not document or document.get("kind") not in WEBHOOK_CONFIGURATIONS:
            continue
        hooks = []
        for hook in document["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            if path.endswith("--v1-pod"):
                hook["namespaceSelector"] = {
                    "matchExpressions": [
                        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": SYSTEM_NAMESPACES}
                    ]
                }
            elif "-kueue-x-k8s-io-" not in path:
                continue  # an integration that is not enabled here
            hook["clientConfig"] = {"url": url + path, "caBundle": ca_bundle}
            hooks.append(hook)
        kind = document["kind"]
        configurations.append(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": kind,
                "metadata": {"name": WEBHOOK_CONFIGURATIONS[kind], "labels": {"app.kubernetes.io/name": NAME}},
                "webhooks": hooks,
            }
        )
    return configurations


def _configuration(state: ClusterState, cert_dir: Path) -> dict[str, Any]:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{state.ports['kueue-health']}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": state.ports["kueue-webhook"], "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "integrations": {"frameworks": ["pod"]},
    }


class LocalKueue:
    """Kueue of one local cluster (its ports and pid are in the cluster's state.json)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.root = cluster.root / NAME
        self.log_path = cluster.logs / f"{NAME}.log"

    def up(self, state: ClusterState, log: Log, deadline: float) -> None:
        """Install the CRDs and webhooks and start the manager (if not running); ``state`` gains its
        ports and pid (the caller saves it). Returns once its webhooks answer."""
        paths = binaries.ensure_all(log, (KUEUE,))
        missing = [name for name in PORTS if name not in state.ports]
        if missing:
            state.ports.update(free_ports_by_name(missing, avoid=set(state.ports.values())))
        source = module_dir()
        cert_dir = self.root / "certs"
        if not (cert_dir / "tls.crt").exists():
            pki.issue_serving(cert_dir, ["127.0.0.1", "localhost"])
        _ensure_metrics_cert(cert_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        config_path = self.root / "config.yaml"
        config_path.write_text(yaml.safe_dump(_configuration(state, cert_dir), sort_keys=False))
        plurals = set()
        for path in sorted((source / "config" / "components" / "crd" / "bases").glob("*.yaml")):
            crd = yaml.safe_load(path.read_text())
            self._apply(state, crd)
            plurals.add(crd["spec"]["names"]["plural"])
        self._apply(state, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        # Kueue sets up its indexes once at start: every kind must be in discovery by then.
        self.cluster.wait_until(lambda: plurals <= self._served(state), "Kueue's CRDs in discovery", deadline)
        if not processes.is_running(state.pids.get(NAME), paths[NAME]):
            log(f"starting kueue {KUEUE_VERSION}")
            argv = [
                str(paths[NAME]),
                f"--config={config_path}",
                f"--kubeconfig={self.cluster.kubeconfig}",
                "--feature-gates=VisibilityOnDemand=false",  # an aggregated API server: not needed here
                "--zap-log-level=info",
            ]
            started = processes.start(argv, self.log_path)
            state.pids[NAME] = started.pid
            state.save(self.cluster.state_path)
            self.cluster.wait_until(
                lambda: self._healthy(state) or started.poll() is not None, "kueue /readyz", deadline
            )
            if started.poll() is not None:
                tail = processes.log_tail(self.log_path)
                raise KueueError(f"kueue exited with code {started.poll()}:\n{tail}")
        try:
            self.cluster.wait_until(lambda: self._healthy(state), "kueue /readyz", deadline)
        except Exception as error:
            raise KueueError(f"kueue did not become ready ({error}):\n{processes.log_tail(self.log_path)}") from None
        url = f"https://127.0.0.1:{state.ports['kueue-webhook']}"
        bundle = base64.b64encode((cert_dir / "ca.crt").read_bytes()).decode()
        manifests = source / "config" / "components" / "webhook" / "manifests.yaml"
        for configuration in _served_webhooks(manifests, url, bundle):
            self._apply(state, configuration)
        log(f"kueue ready (webhooks on {url})")

    def stop(self, state: ClusterState, log: Log) -> None:
        """Unregister the webhooks first (pods must stay creatable without Kueue), then stop it."""
        for kind, name in WEBHOOK_CONFIGURATIONS.items():
            plural = kind.lower() + "s"
            with contextlib.suppress(OSError):  # the API server is already gone
                self.cluster.api_request(state, "DELETE", f"/apis/admissionregistration.k8s.io/v1/{plural}/{name}")
        pid = state.pids.pop(NAME, None)
        if pid:
            processes.stop(pid, binaries.binary_path(NAME))
            log("stopped kueue")
        with contextlib.suppress(OSError):
            released = self._release(state)
            if released:
                log(f"took Kueue's finalizers off {released} object(s)")

    def _release(self, state: ClusterState) -> int:
        """Take Kueue's finalizers off the pods it managed and off its own objects: with Kueue gone
        nothing else would, and their namespaces could never finish deleting."""
        lists = [
            f"/api/v1/pods?labelSelector={MANAGED_LABEL}%3Dtrue",
            *(f"/apis/kueue.x-k8s.io/v1beta2/{plural}" for plural in ("workloads", "localqueues", "clusterqueues")),
        ]
        released = 0
        for collection in lists:
            status, body = self.cluster.api_request(state, "GET", collection)
            if status != 200:
                continue
            for item in json.loads(body)["items"]:
                metadata = item["metadata"]
                finalizers = metadata.get("finalizers") or []
                kept = [name for name in finalizers if not name.startswith(FINALIZER_PREFIX)]
                if kept == finalizers:
                    continue
                where = f"/namespaces/{metadata['namespace']}" if metadata.get("namespace") else ""
                base, _, plural = collection.split("?")[0].rpartition("/")
                path = f"{base}{where}/{plural}/{metadata['name']}"
                with contextlib.suppress(KueueError):  # gone meanwhile
                    self._send(state, "PATCH", path, {"metadata": {"finalizers": kept}}, "application/merge-patch+json")
                    released += 1
        return released

    def running(self, state: ClusterState) -> bool:
        return processes.is_running(state.pids.get(NAME), binaries.binary_path(NAME))

    def _healthy(self, state: ClusterState) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{state.ports['kueue-health']}/readyz", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def _served(self, state: ClusterState) -> set[str]:
        status, body = self.cluster.api_request(state, "GET", "/apis/kueue.x-k8s.io/v1beta2")
        return {resource["name"] for resource in json.loads(body)["resources"]} if status == 200 else set()

    def _apply(self, state: ClusterState, manifest: dict[str, Any]) -> None:
        """Server-side apply ``manifest`` (cluster-scoped) as the field manager ``rankwatch-local``."""
        group_version, kind = manifest["apiVersion"], manifest["kind"]
        prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        path = f"{prefix}/{kind.lower()}s/{manifest['metadata']['name']}?fieldManager=rankwatch-local&force=true"
        self._send(state, "PATCH", path, manifest, "application/apply-patch+yaml")

    def _send(self, state: ClusterState, method: str, path: str, body: dict[str, Any], content_type: str) -> None:
        request = urllib.request.Request(
            self.cluster.server(state) + path,
            method=method,
            data=json.dumps(body).encode(),
            headers={"Content-Type": content_type},
        )
        context: ssl.SSLContext = self.cluster._ssl_context()
        try:
            with urllib.request.urlopen(request, context=context, timeout=30) as response:
                response.read()
        except urllib.error.HTTPError as error:
            reason = error.read().decode(errors="replace")[:500]
            raise KueueError(f"{method} {path.split('?')[0]}: HTTP {error.code}: {reason}") from None


def _ensure_metrics_cert(cert_dir: Path) -> None:
    if (METRICS_CERT_DIR / "tls.crt").exists() and (METRICS_CERT_DIR / "tls.key").exists():
        return
    try:
        METRICS_CERT_DIR.mkdir(parents=True, exist_ok=True)
        for name in ("tls.crt", "tls.key"):
            (METRICS_CERT_DIR / name).write_bytes((cert_dir / name).read_bytes())
    except OSError as error:
        raise KueueError(
            f"Kueue {KUEUE_VERSION} reads its metrics certificate from {METRICS_CERT_DIR} when its internal "
            f"cert management is off, and that path cannot be written here ({error})"
        ) from None
