"""Every Prometheus series the operator process counts, made once when it starts and passed to the parts
that count (one style for all: an object per concern on one registry; nothing registered at import)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry

from rankwatch.alerting.metrics import AlertMetrics
from rankwatch.operator.diagnosis.metrics import DiagnosisMetrics
from rankwatch.operator.remediation.metrics import RemediationMetrics


@dataclass(frozen=True)
class OperatorMetrics:
    diagnosis: DiagnosisMetrics
    remediation: RemediationMetrics
    alerting: AlertMetrics

    @classmethod
    def create(cls, registry: CollectorRegistry = REGISTRY) -> OperatorMetrics:
        """On ``registry`` (the process's, which /metrics serves): once per process."""
        return cls(DiagnosisMetrics(registry), RemediationMetrics(registry), AlertMetrics(registry))
