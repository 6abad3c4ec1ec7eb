"""The operator's configuration: built once at start-up from the environment (the Deployment sets it)
and the command line, validated as a whole, then passed to the parts that need it.

A bad value stops the operator before it does anything, with every problem at once, each naming
the variable, its value and what is expected (``RANKWATCH_BREAKER_MAX_SHARE='1.5': must be within
[0, 1]``); nothing reads the environment later.
"""

from __future__ import annotations

import math
import os
import re
import socket
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from rankwatch import __version__
from rankwatch.config_error import ConfigError
from rankwatch.kube import DEFAULT_REQUEST_TIMEOUT_S
from rankwatch.operator.event_loop import loop_factory
from rankwatch.operator.recovery import archive_endpoints

T = TypeVar("T")


@dataclass(frozen=True)
class WorkerPodSettings:
    """What the operator puts into the jobs' worker pods."""

    image: str = f"rankwatch/rankwatch:{__version__}"
    """Image holding the tracing library (init container) and the sidecar."""
    collector_url: str = "http://rankwatch-operator.rankwatch-system.svc:8080"
    """Where sidecars POST window summaries (the collector Service: it routes to the leader only)."""
    sidecar_metrics_port: int = 9400
    sidecar_endpoint_hosts: tuple[str, ...] = ()
    """Hosts the pod annotation ``rankwatch.io/sidecar-endpoint`` may name (the local cluster: 127.0.0.1).
    Empty: the annotation is ignored, sidecars are asked at their pod IP only (anyone who may edit a pod
    could otherwise send the operator, with the job's token, to any URL)."""
    image_pull_secrets: tuple[str, ...] = ()
    """Secrets (by name, in each job's namespace) for pulling ``image`` into a traced worker pod's init
    container and sidecar; added to the pod's imagePullSecrets."""
    allow_ptrace: bool = True
    """Whether a job may ask for ``spec.sidecar.ptrace`` (SYS_PTRACE on its sidecar); False: such a job
    fails with InvalidSpec naming the setting (chart value ``sidecar.allowPtrace``)."""


@dataclass(frozen=True)
class WebhookSettings:
    """The mutating admission webhook that injects pods of other kinds (``kinds/``); off without ``listen``."""

    listen: tuple[str, int] | None = None
    """host:port of its HTTPS server; None: not served (its MutatingWebhookConfiguration is not installed)."""
    cert_dir: str | None = None
    """Holds ``tls.crt`` and ``tls.key`` (a kubernetes.io/tls Secret, from the chart or cert-manager);
    re-read when they change."""


@dataclass(frozen=True)
class DiagnosisLimits:
    """How much of the operator diagnoses may take together (a switch failure slows many jobs at once)."""

    concurrency: int = 2
    """Diagnoses running at once; more wait in a queue, most severe first."""
    memory_bytes: int = 512 << 20
    """Memory all running diagnoses may use together; each worker process gets an equal share and is
    killed (and the diagnosis reported failed) beyond it."""
    timeout_seconds: float = 300.0
    """A diagnosis (dumps + analysis) taking longer is stopped and reported."""

    @property
    def worker_memory_bytes(self) -> int:
        return self.memory_bytes // self.concurrency


@dataclass(frozen=True)
class LeaderElection:
    """One active replica: the holder of a coordination.k8s.io Lease runs everything; the others wait."""

    enabled: bool = True
    lease_name: str = "rankwatch-operator"
    lease_namespace: str = "default"
    identity: str = ""
    """``<pod name>_<random>``: who holds the Lease (``kubectl get lease``)."""
    lease_seconds: float = 8.0
    """A leader that has not renewed for this long is gone: a standby takes the Lease."""
    renew_deadline_seconds: float = 6.0
    """A leader that could not renew for this long stops acting (before anyone else may start)."""
    retry_seconds: float = 1.0
    """How often the leader renews and a standby looks."""


@dataclass(frozen=True)
class AlertingSettings:
    config_path: str | None = None
    """The alerting config (a mounted ConfigMap); None: no alerts are sent."""
    namespace: str = "rankwatch-system"
    """Where its Secrets and its store live (the operator's own namespace)."""


@dataclass(frozen=True)
class CollectorSettings:
    """The collector's HTTP server (``diagnosis/ingest/collector.py``): where it listens and what it admits."""

    host: str = "0.0.0.0"
    port: int = 8080
    rate_per_job: float = 200.0
    """Messages per second per job: a 1,000-pod job with 5 s windows sends 200."""
    burst_per_job: float = 2000.0
    inflight_body_bytes: int = 64 << 20
    """Request bodies held at once as sent (gzip'd), over all requests: beyond it a request is answered 503
    (retry). What they inflate to is bounded where they are inflated: a parsing worker inflates one body
    at a time, to at most ``protocol.MAX_DECODED_BYTES`` (so many concurrent gzip bombs never inflate
    together)."""
    body_timeout_s: float = 15.0
    """A request body not received within this is answered 408 (a slow client holds nothing longer)."""
    idle_timeout_s: float = 15.0
    """A connection without a complete request head for this long is closed (slowloris)."""
    parse_workers: int = 1
    """Processes that check message bodies off the event loop (``message_parser``); 0: on the loop."""
    serves_metrics: bool = True
    """/metrics on this port too; off when it has a port of its own (``rankwatch.operator.metrics_server``)."""


@dataclass(frozen=True)
class NodeAlertSources:
    """Where the diagnosis reads node alerts (``diagnosis/diagnose/node_alerts.py``; ``RANKWATCH_PROMETHEUS_URL``,
    ``RANKWATCH_ALERTMANAGER_URL``); neither set: it does not look."""

    prometheus_url: str | None = None
    alertmanager_url: str | None = None
    timeout_seconds: float = 5.0
    """Per source; a diagnosis waits no longer than this for alerts."""

    @property
    def configured(self) -> bool:
        return bool(self.prometheus_url or self.alertmanager_url)


@dataclass(frozen=True)
class BreakerSettings:
    """The circuit breaker (``remediation/circuit_breaker.py``): how many cordons a window may hold."""

    max_share: float = 0.10
    """Share of all nodes. NVSentinel's default is 50% for generic node health; rankwatch's own
    signal (one job's diagnosis) is narrower, and a training cluster rarely loses even 1% of its
    nodes to independent faults within minutes, so 10% leaves room for real bursts while a
    systemic false positive stops long before it empties the cluster."""
    min_nodes: int = 1
    """Floor on the cap, so a small cluster (4 nodes: 10% is 0.4) can still cordon one node."""
    window_seconds: float = 900.0
    """Longer than the spread of detection times of one shared cause (sensitivity 300 s by default
    plus diagnosis): the jobs it hits all report within this window."""

    def cap(self, total_nodes: int) -> int:
        """Most nodes rankwatch may have cordoned within the window."""
        return max(self.min_nodes, math.floor(self.max_share * total_nodes + 1e-9))


@dataclass(frozen=True)
class Safeguards:
    """Operator-wide limits on cordons a job's spec cannot raise (``remediation/cordon_decision.py``)."""

    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    cooldown_seconds: float = 1800.0
    """After an undo (a person judged the node good), the node is left alone this long, so a
    diagnosis still pending on the old evidence does not cordon it again at once."""
    min_confidence: float = 0.0
    """Diagnoses below this confidence are recorded but cordon nothing (0: every diagnosis acts)."""
    max_nodes_per_namespace: int = 4
    """Most nodes rankwatch holds cordoned at once for the jobs of one namespace, however old the
    cordons: the breaker limits only the rate, so one team's diagnoses, window after window, could
    otherwise take the whole cluster."""
    max_nodes: int = 16
    """Most nodes rankwatch holds cordoned at once, all namespaces together."""
    shared_expiry_seconds: float = 3600.0
    """A cordon of a node on which pods of other namespaces ran (or when rankwatch cannot tell) is
    undone by rankwatch after this long; a node only the job's own namespace used stays cordoned
    until a person undoes it."""


@dataclass(frozen=True)
class OperatorConfig:
    namespaces: tuple[str, ...] = ()
    """Namespaces (globs allowed) to watch; empty: every namespace."""
    pods: WorkerPodSettings = field(default_factory=WorkerPodSettings)
    status_debounce_seconds: float = 0.5
    """Pod events of one job within this delay are folded into one status update."""
    collector: CollectorSettings = field(default_factory=CollectorSettings)
    probe_listen: tuple[str, int] | None = None
    """host:port of /healthz (alive) and /readyz (the leader, collector up); None: not served."""
    metrics_listen: tuple[str, int] | None = None
    """host:port of /metrics on a port of its own (the leader's); None: /metrics on the collector's port."""
    diagnosis: DiagnosisLimits = field(default_factory=DiagnosisLimits)
    safeguards: Safeguards = field(default_factory=Safeguards)
    alerting: AlertingSettings = field(default_factory=AlertingSettings)
    leader: LeaderElection = field(default_factory=LeaderElection)
    metrics_ranks_per_job: int = 32
    """At most this many per-rank series (``rankwatch_rank_wait_seconds``) per job on /metrics."""
    node_alerts: NodeAlertSources = field(default_factory=NodeAlertSources)
    """Where a diagnosis reads the firing alerts of the nodes it names (none: it does not)."""
    api_timeout_seconds: float = DEFAULT_REQUEST_TIMEOUT_S
    """Longest one Kubernetes API call may take (the operator's client and kopf's); a call cut off
    fails and is retried, so a partition that holds a connection open cannot hang a diagnosis or a
    cordon. A watch that carries nothing for its 300 s plus this long is opened again."""
    event_loop: str = "asyncio"
    """The operator's event loop: asyncio's, or uvloop's (``rankwatch.operator.event_loop``)."""
    webhook: WebhookSettings = field(default_factory=WebhookSettings)
    archive_budget_bytes: int = 512 << 20
    """Bytes one archive may take on disk, every pod's dumps and files together (one archive at a time)."""
    archive_endpoints: tuple[str, ...] = ()
    """S3 endpoints (origins: ``scheme://host:port``) a job's archive may name; empty: AWS S3 only
    (``rankwatch.operator.recovery.archive_endpoints``)."""
    no_telemetry_seconds: float = 120.0
    """A running job whose sidecars ship nothing this long (at least 3 of its windows) gets the
    condition NoTelemetry (``diagnosis/report/telemetry_watch.py``)."""

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, namespaces: tuple[str, ...] = (), standalone: bool = False
    ) -> OperatorConfig:
        """Read and check every setting; raises :class:`ConfigError` listing all problems."""
        env = _Env(os.environ if environ is None else environ)
        pods = WorkerPodSettings(
            image=env.get("RANKWATCH_IMAGE", WorkerPodSettings.image, _non_empty),
            collector_url=env.get("RANKWATCH_COLLECTOR_URL", WorkerPodSettings.collector_url, _http_url),
            sidecar_metrics_port=env.get("RANKWATCH_SIDECAR_METRICS_PORT", 9400, _port),
            sidecar_endpoint_hosts=env.get("RANKWATCH_SIDECAR_ENDPOINT_HOSTS", (), _host_list),
            image_pull_secrets=env.get("RANKWATCH_IMAGE_PULL_SECRETS", (), _secret_names),
            allow_ptrace=env.get("RANKWATCH_SIDECAR_ALLOW_PTRACE", True, _boolean),
        )
        rate = env.get("RANKWATCH_COLLECTOR_RATE_PER_JOB", CollectorSettings.rate_per_job, _positive)
        host, port = env.get("RANKWATCH_COLLECTOR_LISTEN", ("0.0.0.0", 8080), _listen)
        parse_workers = env.get("RANKWATCH_COLLECTOR_PARSE_WORKERS", CollectorSettings.parse_workers, _at_least(0))
        metrics_listen = env.get("RANKWATCH_METRICS_LISTEN", None, _listen)
        collector = CollectorSettings(
            host=host,
            port=port,
            rate_per_job=rate,
            burst_per_job=10 * rate,
            parse_workers=parse_workers,
            serves_metrics=metrics_listen is None,
        )
        probe = env.get("RANKWATCH_PROBE_LISTEN", None, _listen)
        limits = DiagnosisLimits(
            concurrency=env.get("RANKWATCH_DIAGNOSIS_CONCURRENCY", DiagnosisLimits.concurrency, _at_least(1)),
            memory_bytes=env.get("RANKWATCH_DIAGNOSIS_MEMORY_MIB", DiagnosisLimits.memory_bytes >> 20, _at_least(64))
            << 20,
            timeout_seconds=env.get("RANKWATCH_DIAGNOSIS_TIMEOUT_SECONDS", DiagnosisLimits.timeout_seconds, _positive),
        )
        if limits.worker_memory_bytes < MIN_WORKER_MEMORY_BYTES:
            env.problems.append(
                f"RANKWATCH_DIAGNOSIS_MEMORY_MIB={limits.memory_bytes >> 20}: leaves "
                f"{limits.worker_memory_bytes >> 20} MiB per diagnosis with RANKWATCH_DIAGNOSIS_CONCURRENCY="
                f"{limits.concurrency}; give at least {MIN_WORKER_MEMORY_BYTES >> 20} MiB per diagnosis"
            )
        breaker = BreakerSettings(
            max_share=env.get("RANKWATCH_BREAKER_MAX_SHARE", BreakerSettings.max_share, _share),
            min_nodes=env.get("RANKWATCH_BREAKER_MIN_NODES", BreakerSettings.min_nodes, _at_least(0)),
            window_seconds=env.get("RANKWATCH_BREAKER_WINDOW_SECONDS", BreakerSettings.window_seconds, _positive),
        )
        safeguards = Safeguards(
            breaker=breaker,
            cooldown_seconds=env.get("RANKWATCH_CORDON_COOLDOWN_SECONDS", Safeguards.cooldown_seconds, _not_negative),
            min_confidence=env.get("RANKWATCH_CORDON_MIN_CONFIDENCE", Safeguards.min_confidence, _share),
            max_nodes_per_namespace=env.get(
                "RANKWATCH_CORDON_MAX_NODES_PER_NAMESPACE", Safeguards.max_nodes_per_namespace, _at_least(0)
            ),
            max_nodes=env.get("RANKWATCH_CORDON_MAX_NODES", Safeguards.max_nodes, _at_least(0)),
            shared_expiry_seconds=env.get(
                "RANKWATCH_CORDON_SHARED_EXPIRY_SECONDS", Safeguards.shared_expiry_seconds, _positive
            ),
        )
        own_namespace = env.get("POD_NAMESPACE", AlertingSettings.namespace, _non_empty)
        alerting = AlertingSettings(
            config_path=env.get("RANKWATCH_ALERTING_CONFIG", None, _readable_file), namespace=own_namespace
        )
        leader = LeaderElection(
            enabled=not standalone,
            lease_name=env.get("RANKWATCH_LEASE_NAME", LeaderElection.lease_name, _non_empty),
            lease_namespace=env.get("RANKWATCH_LEASE_NAMESPACE", env.raw("POD_NAMESPACE") or "default", _non_empty),
            # Unique per process (as controller-runtime does): a restarted container is a new candidate
            # and waits for the Lease like the standby, instead of resuming a leadership it lost.
            identity=f"{env.raw('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}",
            lease_seconds=env.get("RANKWATCH_LEASE_DURATION_SECONDS", LeaderElection.lease_seconds, _positive),
            renew_deadline_seconds=env.get(
                "RANKWATCH_LEASE_RENEW_DEADLINE_SECONDS", LeaderElection.renew_deadline_seconds, _positive
            ),
            retry_seconds=env.get("RANKWATCH_LEASE_RETRY_SECONDS", LeaderElection.retry_seconds, _positive),
        )
        if not leader.retry_seconds < leader.renew_deadline_seconds < leader.lease_seconds:
            env.problems.append(
                "RANKWATCH_LEASE_RETRY_SECONDS < RANKWATCH_LEASE_RENEW_DEADLINE_SECONDS < "
                f"RANKWATCH_LEASE_DURATION_SECONDS must hold (they are {leader.retry_seconds:g}, "
                f"{leader.renew_deadline_seconds:g}, {leader.lease_seconds:g}): a leader must stop before "
                "its Lease expires, and renew several times before that"
            )
        node_alerts = NodeAlertSources(
            prometheus_url=env.get("RANKWATCH_PROMETHEUS_URL", None, _http_url),
            alertmanager_url=env.get("RANKWATCH_ALERTMANAGER_URL", None, _http_url),
            timeout_seconds=env.get(
                "RANKWATCH_NODE_ALERTS_TIMEOUT_SECONDS", NodeAlertSources.timeout_seconds, _positive
            ),
        )
        webhook = WebhookSettings(
            listen=env.get("RANKWATCH_WEBHOOK_LISTEN", None, _listen),
            cert_dir=env.get("RANKWATCH_WEBHOOK_CERT_DIR", None, _cert_dir),
        )
        if webhook.listen is not None and webhook.cert_dir is None:
            env.problems.append(
                "RANKWATCH_WEBHOOK_LISTEN is set but RANKWATCH_WEBHOOK_CERT_DIR is not: the API server calls the "
                "webhook over HTTPS only; name the directory holding tls.crt and tls.key"
            )
        config = cls(
            namespaces=tuple(namespaces),
            pods=pods,
            status_debounce_seconds=env.get(
                "RANKWATCH_STATUS_DEBOUNCE_SECONDS", cls.status_debounce_seconds, _not_negative
            ),
            collector=collector,
            probe_listen=probe,
            metrics_listen=metrics_listen,
            diagnosis=limits,
            safeguards=safeguards,
            alerting=alerting,
            leader=leader,
            metrics_ranks_per_job=env.get("RANKWATCH_METRICS_RANKS_PER_JOB", cls.metrics_ranks_per_job, _at_least(1)),
            node_alerts=node_alerts,
            api_timeout_seconds=env.get("RANKWATCH_API_TIMEOUT_SECONDS", cls.api_timeout_seconds, _positive),
            event_loop=env.get("RANKWATCH_EVENT_LOOP", cls.event_loop, _event_loop),
            webhook=webhook,
            archive_endpoints=env.get("RANKWATCH_ARCHIVE_ENDPOINTS", (), _origin_list),
            archive_budget_bytes=env.get("RANKWATCH_ARCHIVE_BUDGET_MIB", cls.archive_budget_bytes >> 20, _at_least(16))
            << 20,
            no_telemetry_seconds=env.get("RANKWATCH_NO_TELEMETRY_SECONDS", cls.no_telemetry_seconds, _positive),
        )
        if env.problems:
            raise ConfigError(env.problems)
        return config


MIN_WORKER_MEMORY_BYTES = 128 << 20
"""Below this a diagnosis worker cannot hold the analysis' own code and numpy, let alone a dump."""


class _Env:
    """Reads variables, converting and checking each; problems are collected, not raised one by one."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ
        self.problems: list[str] = []

    def raw(self, name: str) -> str | None:
        return self.environ.get(name) or None

    def get(self, name: str, default: T, parse: Callable[[str], T]) -> T:
        value = self.environ.get(name)
        if value is None or value == "":
            return default
        try:
            return parse(value.strip())
        except ValueError as error:
            self.problems.append(f"{name}={value!r}: {error}")
            return default


def _non_empty(value: str) -> str:
    if not value:
        raise ValueError("must not be empty")
    return value


def _boolean(value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise ValueError("expected true or false")
    return value.lower() == "true"


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError("not a number") from None


def _positive(value: str) -> float:
    number = _number(value)
    if not number > 0:
        raise ValueError("must be greater than 0")
    return number


def _not_negative(value: str) -> float:
    number = _number(value)
    if number < 0:
        raise ValueError("must not be negative")
    return number


def _share(value: str) -> float:
    number = _number(value)
    if not 0 <= number <= 1:
        raise ValueError("must be within [0, 1]")
    return number


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise ValueError("not a whole number") from None
        if number < minimum:
            raise ValueError(f"must be at least {minimum}")
        return number

    return parse


def _event_loop(value: str) -> str:
    loop_factory(value)  # an unknown name, or uvloop not installed, is refused here
    return value


def _port(value: str) -> int:
    port = _at_least(1)(value)
    if port > 65535:
        raise ValueError("not a port (1-65535)")
    return port


def _listen(value: str) -> tuple[str, int]:
    host, colon, port = value.rpartition(":")
    if not colon:
        raise ValueError("expected host:port, e.g. 0.0.0.0:8080 (port 0: any free port)")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"port {port!r} is not a number (expected host:port)") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"port {number} is out of range")
    return host or "0.0.0.0", number


def _secret_names(value: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    bad = [name for name in names if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", name)]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a Secret name (comma-separated names, e.g. registry-credentials)")
    return names


def _host_list(value: str) -> tuple[str, ...]:
    hosts = tuple(host.strip().strip("[]").lower() for host in value.split(",") if host.strip())
    bad = [host for host in hosts if not re.fullmatch(r"[a-z0-9.:-]+", host) or "*" in host]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a host name or IP address (comma-separated, no wildcards)")
    return hosts


def _origin_list(value: str) -> tuple[str, ...]:
    return tuple(archive_endpoints.origin(url) for url in value.split(",") if url.strip())


def _http_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected an http(s) URL, e.g. http://rankwatch-collector.rankwatch-system.svc:8080")
    return value.rstrip("/")


def _cert_dir(value: str) -> str:
    missing = [name for name in ("tls.crt", "tls.key") if not (Path(value) / name).is_file()]
    if missing:
        raise ValueError(f"no {' or '.join(missing)} in it (the webhook's certificate Secret is mounted there)")
    return value


def _readable_file(value: str) -> str:
    path = Path(value)
    if not path.is_file():
        raise ValueError("no such file (the alerting config is mounted from a ConfigMap)")
    try:
        path.read_bytes()
    except OSError as error:
        raise ValueError(f"cannot be read: {error.strerror}") from None
    return value
