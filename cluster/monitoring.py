"""A real Prometheus and Alertmanager beside the local control plane: `rankwatch cluster up --monitoring`.

Both run as local processes built from their Go modules (cluster/gomod/prometheus, .../alertmanager),
listen on loopback ports chosen at the first `up --monitoring` and keep their configuration, data and
logs in the cluster directory (``monitoring/``, ``logs/``); `down` stops them with the rest.

Prometheus loads the chart's rules (``helm/rankwatch/rules``) and sends to the Alertmanager. It scrapes

- the sidecars of TrainingJob pods, found through the API server (Kubernetes SD, role pod, as the
  chart's PodMonitor does: port ``rw-metrics``, labels ``namespace``, ``pod``, ``trainingjob``,
  ``node``), at the address the pod runner annotates (``rankwatch.io/sidecar-endpoint``: kwok pod IPs
  are not routable);
- local processes named in ``monitoring/targets/<job>.json`` (file SD; ``scrape(job, [host:port])``
  writes one): the operator the demo or the tests run (job ``rankwatch-operator``, as the chart's
  ServiceMonitor names it), an alert receiver.

The Alertmanager routes alerts with a level (``severity`` P0-P3) to one webhook, rankwatch's intake
(``route_alerts_to(url)``: the operator's ``/alerting/alertmanager`` or `rankwatch alerts serve`'s),
and the rest nowhere.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from rankwatch.cluster import binaries, kubeconfig, pki, processes
from rankwatch.cluster.binaries import Log
from rankwatch.cluster.state import ClusterState, free_ports_by_name, port_free
from rankwatch.cluster.versions import MONITORING

if TYPE_CHECKING:
    from rankwatch.cluster.local import LocalCluster

ORDER = ("alertmanager", "prometheus")
CHART_RULES = Path(__file__).parents[1] / "helm" / "rankwatch" / "rules"
PROMETHEUS_IDENTITY = pki.ClientIdentity("prometheus", "rankwatch-local-prometheus")
SIDECAR_PORT_NAME = "rw-metrics"  # rankwatch.operator.lifecycle.pod_spec.SIDECAR_METRICS_PORT_NAME
SIDECAR_ENDPOINT_ANNOTATION = "rankwatch.io/sidecar-endpoint"  # what the pod runner annotates
LEVEL_MATCHER = 'severity=~"P[0-3]"'


class MonitoringError(RuntimeError):
    """The monitoring stack could not be brought up or reconfigured; the message says why."""


@dataclass(frozen=True)
class MonitoringSettings:
    """How often Prometheus scrapes and evaluates, which rules it loads, how Alertmanager groups.
    Tests shorten all of it; the defaults suit a person watching the demo."""

    scrape_interval: str = "5s"
    evaluation_interval: str = "5s"
    rule_files: tuple[Path, ...] = ()
    """Empty: every ``*.yaml`` under the chart's ``rules/``."""
    group_wait: str = "5s"
    group_interval: str = "1m"
    repeat_interval: str = "1h"


def _rbac(user: str) -> list[tuple[str, dict[str, Any]]]:
    """What Kubernetes SD (role pod) needs: read pods, nothing else."""
    name = "rankwatch-local-prometheus"
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }
    return [
        ("/apis/rbac.authorization.k8s.io/v1/clusterroles", role),
        ("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", binding),
    ]


class LocalMonitoring:
    """The monitoring stack of one local cluster (its state is the cluster's state.json)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.root = cluster.root / "monitoring"
        self.targets = self.root / "targets"
        self.receiver_path = self.root / "receiver.json"

    # ---- addresses --------------------------------------------------------------------------------
    def _state(self) -> ClusterState:
        state = ClusterState.load(self.cluster.state_path)
        if state is None or "prometheus" not in state.ports:
            raise MonitoringError("no monitoring on this cluster: run `rankwatch cluster up --monitoring`")
        return state

    @property
    def prometheus_url(self) -> str:
        return f"http://{_local(self._state(), 'prometheus')}"

    @property
    def alertmanager_url(self) -> str:
        return f"http://{_local(self._state(), 'alertmanager')}"

    # ---- configuration ----------------------------------------------------------------------------
    def _rule_files(self, settings: MonitoringSettings) -> list[str]:
        files = list(settings.rule_files) or sorted(CHART_RULES.glob("*.yaml"))
        missing = [str(path) for path in files if not Path(path).is_file()]
        if not files or missing:
            raise MonitoringError(f"rule files not found: {missing or CHART_RULES}")
        return [str(Path(path).resolve()) for path in files]

    def prometheus_config(self, state: ClusterState, settings: MonitoringSettings) -> dict[str, Any]:
        meta = "__meta_kubernetes_pod_"
        annotation = meta + "annotation_" + _label_name(SIDECAR_ENDPOINT_ANNOTATION)
        return {
            "global": {
                "scrape_interval": settings.scrape_interval,
                "scrape_timeout": settings.scrape_interval,
                "evaluation_interval": settings.evaluation_interval,
                "external_labels": {"cluster": "rankwatch-local"},
            },
            "rule_files": self._rule_files(settings),
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [_local(state, "alertmanager")]}]}]},
            "scrape_configs": [
                {"job_name": "prometheus", "static_configs": [{"targets": [_local(state, "prometheus")]}]},
                {
                    "job_name": "local-processes",  # each targets/<job>.json names its own job label
                    "file_sd_configs": [{"files": [str(self.targets / "*.json")], "refresh_interval": "5s"}],
                },
                {
                    "job_name": "rankwatch-sidecar",
                    "kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": str(self._kubeconfig_path())}],
                    "relabel_configs": [
                        {"source_labels": [meta + "container_port_name"], "regex": SIDECAR_PORT_NAME, "action": "keep"},
                        {"source_labels": [meta + "phase"], "regex": "Running", "action": "keep"},
                        {
                            "source_labels": [annotation],
                            "regex": "https?://([^/]+)/?",
                            "target_label": "__address__",
                            "replacement": "$1",
                        },
                        {"source_labels": [annotation], "regex": ".+", "action": "keep"},
                        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                        {"source_labels": [meta + "name"], "target_label": "pod"},
                        {"source_labels": [meta + "label_rankwatch_io_job_name"], "target_label": "trainingjob"},
                        {"source_labels": [meta + "node_name"], "target_label": "node"},
                    ],
                },
            ],
        }

    def alertmanager_config(self, settings: MonitoringSettings) -> dict[str, Any]:
        receiver = self._receiver()
        receivers: list[dict[str, Any]] = [{"name": "unrouted"}]
        routes = []
        if receiver is not None:
            webhook: dict[str, Any] = {"url": receiver["url"], "send_resolved": True, "max_alerts": 0}
            if receiver.get("bearer_token_file"):
                webhook["http_config"] = {
                    "authorization": {"type": "Bearer", "credentials_file": receiver["bearer_token_file"]}
                }
            receivers.append({"name": "rankwatch", "webhook_configs": [webhook]})
            routes.append({"receiver": "rankwatch", "matchers": [LEVEL_MATCHER]})
        return {
            "route": {
                "receiver": "unrouted",
                "group_by": ["alertname", "namespace", "trainingjob", "node"],
                "group_wait": settings.group_wait,
                "group_interval": settings.group_interval,
                "repeat_interval": settings.repeat_interval,
                "routes": routes,
            },
            "receivers": receivers,
        }

    def _receiver(self) -> dict[str, str] | None:
        try:
            return json.loads(self.receiver_path.read_text())
        except FileNotFoundError:
            return None

    def _kubeconfig_path(self) -> Path:
        return self.root / "prometheus.kubeconfig"

    def _write(self, state: ClusterState, settings: MonitoringSettings) -> None:
        self.targets.mkdir(parents=True, exist_ok=True)
        saved = {**settings.__dict__, "rule_files": self._rule_files(settings)}
        (self.root / "settings.json").write_text(json.dumps(saved))
        _write_yaml(self.root / "prometheus.yml", self.prometheus_config(state, settings))
        _write_yaml(self.root / "alertmanager.yml", self.alertmanager_config(settings))

    def _settings(self) -> MonitoringSettings:
        try:
            saved = json.loads((self.root / "settings.json").read_text())
        except FileNotFoundError:
            return MonitoringSettings()
        return MonitoringSettings(**{**saved, "rule_files": tuple(Path(p) for p in saved["rule_files"])})

    def _argv(self, name: str, state: ClusterState, paths: dict[str, Path]) -> list[str]:
        if name == "prometheus":
            return [
                str(paths["prometheus"]),
                f"--config.file={self.root / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.root / 'prometheus-data'}",
                "--storage.tsdb.retention.time=2d",
                f"--web.listen-address=127.0.0.1:{state.ports['prometheus']}",
                "--web.enable-lifecycle",  # POST /-/reload after a config change
                "--log.level=warn",
            ]
        return [
            str(paths["alertmanager"]),
            f"--config.file={self.root / 'alertmanager.yml'}",
            f"--storage.path={self.root / 'alertmanager-data'}",
            f"--web.listen-address=127.0.0.1:{state.ports['alertmanager']}",
            "--cluster.listen-address=",  # one instance: no gossip port
            "--log.level=warn",
        ]

    # ---- lifecycle -----------------------------------------------------------------------------------
    def up(self, state: ClusterState, settings: MonitoringSettings | None, log: Log, deadline: float) -> None:
        """Start (or reconfigure and reload) both; ``state`` gains their ports and pids (caller saves it)."""
        settings = settings or self._settings()
        paths = binaries.ensure_all(log, MONITORING)
        missing = [name for name in ORDER if name not in state.ports]
        if missing:
            state.ports.update(free_ports_by_name(missing, avoid=set(state.ports.values())))
        self.root.mkdir(parents=True, exist_ok=True)
        self._identity(state)
        self._write(state, settings)
        for name in ORDER:
            if processes.is_running(state.pids.get(name), paths[name]):
                self._reload(name, state)
                continue
            log(f"starting {name}")
            self.cluster.wait_until(lambda p=state.ports[name]: port_free(p), f"port {state.ports[name]}", deadline)
            started = processes.start(self._argv(name, state, paths), self.cluster.logs / f"{name}.log")
            state.pids[name] = started.pid
            state.save(self.cluster.state_path)
            try:
                self.cluster.wait_until(lambda n=name: self._ready(n, state), f"{name} /-/ready", deadline)
            except Exception as error:
                tail = processes.log_tail(self.cluster.logs / f"{name}.log")
                raise MonitoringError(f"{name} did not become ready ({error}):\n{tail}") from None
        log(
            f"monitoring ready: Prometheus http://{_local(state, 'prometheus')}, "
            f"Alertmanager http://{_local(state, 'alertmanager')}"
        )

    def _identity(self, state: ClusterState) -> None:
        """A client certificate that may only read pods, for Kubernetes SD."""
        if not (self.cluster.pki / f"{PROMETHEUS_IDENTITY.stem}.crt").exists():
            pki.issue_client(self.cluster.pki, PROMETHEUS_IDENTITY)
        for path, body in _rbac(PROMETHEUS_IDENTITY.user):
            status, text = self.cluster.api_request(state, "POST", path, body)
            if status not in (201, 409):
                what = f"{body['kind']} {body['metadata']['name']}"
                raise MonitoringError(f"creating {what}: HTTP {status}: {text[:300]!r}")
        server = self.cluster.server(state)
        kubeconfig.write(self._kubeconfig_path(), server, self.cluster.pki, PROMETHEUS_IDENTITY.stem)

    def _ready(self, name: str, state: ClusterState) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{state.ports[name]}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def _reload(self, name: str, state: ClusterState) -> None:
        request = urllib.request.Request(f"http://127.0.0.1:{state.ports[name]}/-/reload", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                response.read()
        except urllib.error.HTTPError as error:
            # Both answer 500 with the reason when the new configuration does not load.
            reason = error.read().decode(errors="replace")
            raise MonitoringError(f"{name} refused its new configuration: {reason}") from None

    def stop(self, state: ClusterState, log: Log) -> None:
        for name in reversed(ORDER):
            pid = state.pids.pop(name, None)
            if pid:
                processes.stop(pid, binaries.binary_path(name))
                log(f"stopped {name}")

    def status(self, state: ClusterState) -> dict[str, bool]:
        return {
            name: processes.is_running(state.pids.get(name), binaries.binary_path(name))
            for name in ORDER
            if name in state.ports
        }

    # ---- what to scrape, where to send --------------------------------------------------------------
    def scrape(self, job: str, targets: list[str], labels: dict[str, str] | None = None) -> Path:
        """Scrape ``targets`` (host:port, path /metrics) with job label ``job``; an empty list stops it."""
        if not job.replace("-", "").replace("_", "").isalnum():
            raise MonitoringError(f"job name {job!r}: use letters, digits, '-' and '_'")
        self._state()  # refuses when this cluster has no monitoring
        path = self.targets / f"{job}.json"
        if not targets:
            path.unlink(missing_ok=True)
            return path
        self.targets.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, json.dumps([{"targets": targets, "labels": {**(labels or {}), "job": job}}]))
        return path

    def route_alerts_to(self, url: str | None, bearer_token_file: str | None = None) -> None:
        """Send alerts with a level to this Alertmanager webhook receiver (None: to nowhere); reloads."""
        state = self._state()
        if url is None:
            self.receiver_path.unlink(missing_ok=True)
        else:
            receiver = {"url": url, **({"bearer_token_file": bearer_token_file} if bearer_token_file else {})}
            _write_atomically(self.receiver_path, json.dumps(receiver))
        _write_yaml(self.root / "alertmanager.yml", self.alertmanager_config(self._settings()))
        self._reload("alertmanager", state)


def _local(state: ClusterState, name: str) -> str:
    return f"127.0.0.1:{state.ports[name]}"


def _label_name(text: str) -> str:
    """As Prometheus turns an annotation or label name into part of a meta label name."""
    return "".join(c if c.isalnum() or c == "_" else "_" for c in text)


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def _write_yaml(path: Path, data: dict[str, Any]) -> None:
    _write_atomically(path, yaml.safe_dump(data, sort_keys=False))
