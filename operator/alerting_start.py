"""Start the alert pipeline without ever stopping the operator.

Alerting is an add-on to diagnosing and cordoning: a missing Secret, a bad config or an unreachable
alert store must not cost every job its operator. When the pipeline cannot start, the operator runs
on without it and says so where an operator-level problem is seen: a Warning Event
``AlertingNotReady`` on its own pod (``kubectl describe pod``), the gauge ``rankwatch_alerting_ready``
at 0 (the chart's rule ``RankwatchAlertingNotReady`` fires on it) and its log. Fix the cause and
restart the operator pods (``kubectl rollout restart``): the config and its Secrets are read at start.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch.model import event_reasons
from rankwatch.operator.config import AlertingSettings
from rankwatch.operator.events import EventTarget, post_event

if TYPE_CHECKING:
    from rankwatch.alerting.metrics import AlertMetrics

log = logging.getLogger(__name__)

NOT_READY_REASON = event_reasons.ALERTING_NOT_READY


async def start_alerting(
    settings: AlertingSettings, kube: kubernetes.client.ApiClient, make_metrics: Callable[[], AlertMetrics]
) -> Any:
    """The running ``AlertPipeline``, or None when alerting is off or cannot start (then reported).
    ``make_metrics`` is called only when alerting is configured: off, it has no series."""
    if not settings.config_path:
        return None
    metrics = make_metrics()
    from rankwatch.alerting import AlertPipeline, kubernetes_resolver, load_config, open_store

    try:
        secrets = kubernetes_resolver(settings.namespace, kube)
        alerting = await asyncio.to_thread(load_config, Path(settings.config_path), secrets)
        store = await asyncio.to_thread(open_store, alerting.store, kube, settings.namespace)
        pipeline = AlertPipeline(alerting, store=store, metrics=metrics)
        await pipeline.start()
    except Exception as error:  # alerting, whatever its fault, must not take the operator down
        # ConfigError and StoreError messages name a Secret by its source, never its value.
        problem = f"alerting config {settings.config_path}: {error}"
        metrics.ready.set(0)
        log.error("alerting is off until the operator restarts: %s", problem)
        await asyncio.to_thread(_report_on_own_pod, kube, problem)
        return None
    return pipeline  # rankwatch_alerting_ready 1 (the pipeline's start)


def _report_on_own_pod(kube: kubernetes.client.ApiClient, problem: str) -> None:
    """A Warning Event on the operator's pod ($POD_NAME in $POD_NAMESPACE, set by the chart); nothing
    outside a pod. Failures are logged: the Event is auxiliary, the metric and the log remain."""
    name, namespace = os.environ.get("POD_NAME"), os.environ.get("POD_NAMESPACE")
    if not (name and namespace):
        return
    message = (
        f"{problem}. The operator diagnoses and cordons, but sends no alerts: fix the config or create "
        "the Secret, then restart the operator pods (kubectl rollout restart deployment)."
    )
    try:
        pod = kubernetes.client.CoreV1Api(kube).read_namespaced_pod(name, namespace)
        target = EventTarget("v1", "Pod", name, pod.metadata.uid, namespace)
        post_event(kube, target, type="Warning", reason=NOT_READY_REASON, message=message,
                   key=NOT_READY_REASON, repeat=True, now=datetime.datetime.now(datetime.UTC))  # fmt: skip
    except ApiException as error:
        log.warning("Event %s on pod %s/%s not posted: HTTP %s", NOT_READY_REASON, namespace, name, error.status)
