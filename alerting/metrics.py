"""Prometheus counters of the alert path. Labels are bounded: level (4), receiver (config), reason, source."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from rankwatch.alerting.model import Level

SUPPRESSION_REASONS = ("duplicate", "silenced", "inhibited", "storm")
SOURCES = ("rankwatch", "alertmanager")


class AlertMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.received = Counter(
            "rankwatch_alerts_received",
            "Alerts submitted to the alert pipeline (job findings, Alertmanager webhook).",
            ["level", "source"],
            registry=registry,
        )
        self.sent = Counter(
            "rankwatch_alerts_sent",
            "Alerts in notifications a receiver accepted (a storm summary counts the alerts it stands for).",
            ["level", "receiver"],
            registry=registry,
        )
        self.failed = Counter(
            "rankwatch_alerts_failed",
            "Alerts in notifications a receiver did not accept after the retries.",
            ["level", "receiver", "reason"],
            registry=registry,
        )
        self.suppressed = Counter(
            "rankwatch_alerts_suppressed",
            "Alerts not notified: duplicate of a firing alert, silenced, inhibited, or held back by storm control.",
            ["level", "reason"],
            registry=registry,
        )

        # Born with the first pipeline of the process (or its failed start): a process that runs no
        # alerting (the operator with alerting off) has no series for RankwatchAlertingNotReady to see.
        self.ready = Gauge(
            "rankwatch_alerting_ready",
            "1: the alert pipeline runs; 0: an alerting config is given but cannot be used (a missing Secret, a "
            "bad config, no alert store; the operator's pod has an AlertingNotReady Event saying why)",
            registry=registry,
        )

    def start_at_zero(self, receivers: Iterable[str], reasons: Iterable[str]) -> None:
        """Create every (level, receiver[, reason]) series at 0: ``increase()`` in a rule then sees the
        first alert or failure (a counter series born at 1 shows no increase)."""
        levels = [level.value for level in Level]
        reasons = tuple(reasons)
        for level in levels:
            for source in SOURCES:
                self.received.labels(level, source)
            for receiver in receivers:
                self.sent.labels(level, receiver)
                for reason in reasons:
                    self.failed.labels(level, receiver, reason)

    @classmethod
    def uncounted(cls) -> AlertMetrics:
        """Series nobody serves (a private registry): for a caller outside the operator, such as the CLI."""
        return cls(CollectorRegistry())
