"""What the leader runs beside kopf's handlers: the collector (sidecar summaries, Alertmanager intake,
/metrics), the monitor (detector, diagnoses and their follow-ups), recovery (evidence archive,
restarts), the alert pipeline and the expiry of cordons of shared nodes.

Started by a kopf startup handler, so only on the replica that holds the Lease (``main.py`` starts
kopf only there), and stopped by its cleanup handler, before the Lease is given up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import kubernetes
from prometheus_client import REGISTRY

from rankwatch.operator.alerting_start import start_alerting
from rankwatch.operator.config import OperatorConfig
from rankwatch.operator.diagnosis.ingest.collector import Collector, SecretTokens
from rankwatch.operator.diagnosis.ingest.job_state import JobStore, StateLimits
from rankwatch.operator.diagnosis.monitor import Monitor
from rankwatch.operator.diagnosis.report.job_metrics import JobMetrics, JobMetricsSettings
from rankwatch.operator.metrics_server import MetricsServer
from rankwatch.operator.operator_metrics import OperatorMetrics
from rankwatch.operator.recovery.reconcile import Recovery
from rankwatch.operator.remediation.cordon import expire_cordons_periodically

log = logging.getLogger(__name__)


class Watch:
    def __init__(
        self,
        config: OperatorConfig,
        kube: kubernetes.client.ApiClient,
        leading: Callable[[], bool],
        metrics: OperatorMetrics,
    ) -> None:
        self.config, self.kube, self.leading, self.metrics = config, kube, leading, metrics
        self.collector: Collector | None = None
        self.monitor: Monitor | None = None
        self.recovery: Recovery | None = None
        self.alerts: Any = None
        self.job_metrics: JobMetrics | None = None
        self.cordon_expiry: asyncio.Task[None] | None = None
        self.metrics_server: MetricsServer | None = None

    async def start(self) -> None:
        config = self.config
        self.alerts = await start_alerting(config.alerting, self.kube, lambda: self.metrics.alerting)
        store, tokens = JobStore(on_drop=self.metrics.diagnosis.dropped), SecretTokens(self.kube)
        self.job_metrics = JobMetrics(
            store, JobMetricsSettings(rank_series_per_job=config.metrics_ranks_per_job), leading=self.leading
        )
        REGISTRY.register(self.job_metrics)
        self.monitor = Monitor(
            self.kube,
            store,
            tokens,
            config,
            alerts=self.alerts,
            leading=self.leading,
            job_metrics=self.job_metrics,
            metrics=self.metrics.diagnosis,
            remediation_metrics=self.metrics.remediation,
        )
        self.collector = Collector(
            store,
            tokens,
            config.collector,
            on_stall=self.monitor.wake,
            jobs=self._job_limits,
            metrics=self.metrics.diagnosis,
        )
        if self.alerts is not None:
            from rankwatch.alerting import add_routes

            add_routes(self.collector.app, self.alerts)
        await self.collector.start()
        if config.metrics_listen is not None:
            self.metrics_server = MetricsServer(*config.metrics_listen)
            await self.metrics_server.start()
        self.monitor.start()
        self.cordon_expiry = asyncio.create_task(
            expire_cordons_periodically(self.kube, self.metrics.remediation), name="cordon-expiry"
        )
        self.recovery = Recovery(
            self.kube, config, tokens, new_attempt=self.monitor.new_attempt, diagnosing=self.monitor.diagnosing
        )

    def _job_limits(self, namespace: str, name: str) -> StateLimits | None:
        """How much state a followed job may hold; None for a job the monitor does not follow (no such
        job, tracing off, or ended): the collector keeps nothing for it."""
        job = self.monitor.jobs.get((namespace, name)) if self.monitor else None
        return None if job is None else job.limits

    async def stop(self) -> None:
        if self.cordon_expiry:
            self.cordon_expiry.cancel()
            await asyncio.gather(self.cordon_expiry, return_exceptions=True)
            self.cordon_expiry = None
        if self.recovery:
            await self.recovery.stop()
        if self.monitor:
            await self.monitor.stop()
        if self.collector:
            await self.collector.stop()
        if self.metrics_server:
            await self.metrics_server.stop()
            self.metrics_server = None
        if self.alerts is not None:
            await self.alerts.stop()
        if self.job_metrics is not None:
            REGISTRY.unregister(self.job_metrics)
        self.collector = self.monitor = self.recovery = self.alerts = self.job_metrics = None
