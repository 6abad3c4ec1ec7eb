"""Operator-wide settings, read once from the environment (the Deployment sets them)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from rankwatch import __version__


@dataclass(frozen=True)
class OperatorConfig:
    image: str = f"rankwatch/rankwatch:{__version__}"
    """Image holding the tracing library (init container) and the sidecar."""
    collector_url: str = "http://rankwatch-operator.rankwatch-system.svc:8080"
    """Where sidecars POST window summaries."""
    sidecar_metrics_port: int = 9400
    status_debounce_seconds: float = 0.5
    """Pod events of one job within this delay are folded into one status update."""
    collector_listen: str = "0.0.0.0:8080"
    """host:port of the collector (and the operator's /metrics); port 0 picks a free one."""
    collector_rate_per_job: float = 200.0
    """Sidecar messages per second a job may send (bursts of 10x); beyond, HTTP 429."""
    alerting_config: str | None = None
    """Path of the alerting config (a mounted ConfigMap); unset: no alerts are sent."""
    metrics_ranks_per_job: int = 32
    """At most this many per-rank series (``rankwatch_rank_wait_seconds``) per job on /metrics."""

    @property
    def collector_address(self) -> tuple[str, int]:
        host, _, port = self.collector_listen.rpartition(":")
        try:
            return host or "0.0.0.0", int(port)
        except ValueError:
            raise SystemExit(f"RANKWATCH_COLLECTOR_LISTEN={self.collector_listen!r}: expected host:port") from None

    @classmethod
    def from_env(cls) -> OperatorConfig:
        defaults = cls()
        try:
            return cls(
                image=os.environ.get("RANKWATCH_IMAGE", defaults.image),
                collector_url=os.environ.get("RANKWATCH_COLLECTOR_URL", defaults.collector_url),
                sidecar_metrics_port=int(
                    os.environ.get("RANKWATCH_SIDECAR_METRICS_PORT", defaults.sidecar_metrics_port)
                ),
                status_debounce_seconds=float(
                    os.environ.get("RANKWATCH_STATUS_DEBOUNCE_SECONDS", defaults.status_debounce_seconds)
                ),
                collector_listen=os.environ.get("RANKWATCH_COLLECTOR_LISTEN", defaults.collector_listen),
                collector_rate_per_job=float(
                    os.environ.get("RANKWATCH_COLLECTOR_RATE_PER_JOB", defaults.collector_rate_per_job)
                ),
                alerting_config=os.environ.get("RANKWATCH_ALERTING_CONFIG") or None,
                metrics_ranks_per_job=int(
                    os.environ.get("RANKWATCH_METRICS_RANKS_PER_JOB", defaults.metrics_ranks_per_job)
                ),
            )
        except ValueError as error:
            raise SystemExit(f"rankwatch operator: bad number in environment: {error}") from error
