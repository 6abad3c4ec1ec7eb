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
            )
        except ValueError as error:
            raise SystemExit(f"rankwatch operator: bad number in environment: {error}") from error
