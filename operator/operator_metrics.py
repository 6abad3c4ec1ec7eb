"""Every Prometheus series the operator process counts, made once when it starts and passed to the parts
that count (one style for all: an object per concern on one registry; nothing registered at import)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from prometheus_client import REGISTRY, CollectorRegistry

from rankwatch.alerting.metrics import AlertMetrics
from rankwatch.operator.diagnosis.metrics import DiagnosisMetrics
from rankwatch.operator.remediation.metrics import RemediationMetrics


@dataclass
class OperatorMetrics:
    registry: CollectorRegistry
    diagnosis: DiagnosisMetrics
    remediation: RemediationMetrics
    _alerting: AlertMetrics | None = None

    _made: ClassVar[dict[int, OperatorMetrics]] = {}

    @property
    def alerting(self) -> AlertMetrics:
        """Made when alerting starts: with alerting off there is no alerting series at all (a readiness
        series at 0 would read as "not ready" to the chart's rule)."""
        if self._alerting is None:
            self._alerting = AlertMetrics(self.registry)
        return self._alerting

    @classmethod
    def of(cls, registry: CollectorRegistry = REGISTRY) -> OperatorMetrics:
        """The series on ``registry`` (by default the process's, which /metrics serves), made on the first
        call: a registry takes each series once, and one process may start the operator more than once
        (the e2e tests' in-process operator, a unit test's collector)."""
        made = cls._made.get(id(registry))
        if made is None:
            made = cls._made[id(registry)] = cls(registry, DiagnosisMetrics(registry), RemediationMetrics(registry))
        return made
