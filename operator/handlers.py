"""kopf handlers: the lifecycle of a TrainingJob, kept thin; the work is in the modules they call.

create/resume  -> create the token Secret, the headless Service and the worker Pods
pod/job events -> derive the status from the worker pods (kept in a kopf index, no API lists),
                  post Events on transitions, recreate pods lost before the job started
startup        -> the collector (sidecar summaries, /metrics), the monitor (detector, diagnosis) and
                  recovery (archive, restart) in this event loop; job events tell the monitor which
                  jobs run and recovery which jobs to look at
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf
import kubernetes

import rankwatch.operator.remediation.node_handlers  # noqa: F401  (registers the Node handler: undo by annotation)
from rankwatch.operator import api
from rankwatch.operator.config import OperatorConfig
from rankwatch.operator.diagnosis.collector import Collector, CollectorSettings, SecretTokens
from rankwatch.operator.diagnosis.job_state import JobStore
from rankwatch.operator.diagnosis.monitor import Monitor
from rankwatch.operator.lifecycle import children, job_status
from rankwatch.operator.lifecycle.status_sync import StatusSync, now
from rankwatch.operator.recovery.reconcile import Recovery
from rankwatch.operator.spec import InvalidSpec, TrainingJobSpec

CONFIG = OperatorConfig.from_env()
JOBS = (api.GROUP, api.VERSION, api.PLURAL)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    prefix = api.GROUP
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=prefix)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=prefix, key="last-handled-configuration"
    )
    # Handler log lines stay in the operator's log; Events are posted explicitly, for people.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "rankwatch-operator"
    settings.watching.server_timeout = 300
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        # The library reads $KUBECONFIG at import time; read it now, as kubectl would.
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))


class Watch:
    """The collector and the monitor of this operator process (one each, made at startup)."""

    collector: Collector | None = None
    monitor: Monitor | None = None
    recovery: Recovery | None = None
    alerts: Any = None


WATCH = Watch()


async def _start_alerting(config: OperatorConfig) -> Any:
    """The alert pipeline when RANKWATCH_ALERTING_CONFIG is set; a bad config stops the operator."""
    if not config.alerting_config:
        return None
    from pathlib import Path

    from rankwatch.alerting import AlertPipeline, ConfigError, kubernetes_resolver, load_config

    try:
        secrets = kubernetes_resolver(os.environ.get("POD_NAMESPACE", "rankwatch-system"))
        alerting = await asyncio.to_thread(load_config, Path(config.alerting_config), secrets)
    except ConfigError as error:
        raise kopf.PermanentError(f"alerting config {config.alerting_config}: {error}") from error
    pipeline = AlertPipeline(alerting)
    await pipeline.start()
    return pipeline


@kopf.on.startup()
async def start_watch(**_: Any) -> None:
    """Collector and monitor, in kopf's event loop (settings read now, not at import)."""
    config = OperatorConfig.from_env()
    host, port = config.collector_address
    store, tokens = JobStore(), SecretTokens()
    WATCH.alerts = await _start_alerting(config)
    WATCH.monitor = Monitor(store, tokens, config.sidecar_metrics_port, alerts=WATCH.alerts)
    settings = CollectorSettings(
        host=host,
        port=port,
        rate_per_job=config.collector_rate_per_job,
        burst_per_job=10 * config.collector_rate_per_job,
    )
    WATCH.collector = Collector(store, tokens, settings, on_stall=WATCH.monitor.wake)
    if WATCH.alerts is not None:
        from rankwatch.alerting import add_routes

        add_routes(WATCH.collector.app, WATCH.alerts)
    await WATCH.collector.start()
    WATCH.monitor.start()
    WATCH.recovery = Recovery(
        config, tokens, new_attempt=WATCH.monitor.new_attempt, diagnosing=WATCH.monitor.diagnosing
    )


@kopf.on.cleanup()
async def stop_watch(**_: Any) -> None:
    if WATCH.recovery:
        await WATCH.recovery.stop()
    if WATCH.monitor:
        await WATCH.monitor.stop()
    if WATCH.collector:
        await WATCH.collector.stop()
    if WATCH.alerts is not None:
        await WATCH.alerts.stop()
    WATCH.collector = WATCH.monitor = WATCH.recovery = WATCH.alerts = None


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod: its ServiceAccount; elsewhere: $KUBECONFIG as it is now (not at import time)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.index("pods", labels={api.JOB_NAME_LABEL: kopf.PRESENT})
def worker_pods(namespace: str, labels: dict[str, str], body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, labels[api.JOB_NAME_LABEL]): job_status.WorkerPod.from_pod(body)}


def _fail(body: kopf.Body, patch: kopf.Patch, reason: str, message: str, generation: int) -> None:
    """A job that cannot be run: Failed at once, with the reason on the status and as an Event."""
    moment = now()
    conditions = list(body.get("status", {}).get("conditions") or [])
    conditions = job_status.set_condition(conditions, "Failed", "True", reason, message, moment, generation)
    patch.status.update(phase=job_status.FAILED, message=message, conditions=conditions, completionTime=moment)
    kopf.event(body, type="Warning", reason=reason, message=message)


@kopf.on.resume(*JOBS)
@kopf.on.create(*JOBS)
def create_workers(
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    name: str,
    namespace: str,
    patch: kopf.Patch,
    worker_pods: kopf.Index,
    **_: Any,
) -> None:
    if status.get("phase") in job_status.TERMINAL:
        return
    generation = body["metadata"].get("generation", 1)
    try:
        job_spec = TrainingJobSpec.from_manifest(dict(spec))
        existing = {pod.name for pod in worker_pods.get((namespace, name), [])}
        created = children.ensure_children(dict(body), job_spec, CONFIG, existing)
    except InvalidSpec as error:
        _fail(body, patch, "InvalidSpec", str(error), generation)
        return
    except children.NameConflict as error:
        _fail(body, patch, "NameConflict", str(error), generation)
        return
    if created:
        kopf.event(body, type="Normal", reason="Created", message=f"created {', '.join(created)}")
    if not status.get("conditions"):
        patch.status.update(
            phase=job_status.PENDING,
            health="Unknown",
            workers=f"0/{job_spec.replicas}",
            conditions=job_status.initial_conditions(job_spec, now(), generation),
        )


# ---- status: derived from the pods, on pod and job events, coalesced per job ----------------
STATUS = StatusSync(CONFIG)


@kopf.on.event("pods", labels={api.JOB_NAME_LABEL: kopf.PRESENT})
async def pod_changed(namespace: str, labels: dict[str, str], worker_pods: kopf.Index, **_: Any) -> None:
    STATUS.schedule(namespace, labels[api.JOB_NAME_LABEL], worker_pods)


@kopf.on.event(*JOBS)
async def job_changed(
    namespace: str, name: str, type: str | None, body: kopf.Body, worker_pods: kopf.Index, **_: Any
) -> None:
    if type == "DELETED":
        if WATCH.monitor:
            WATCH.monitor.forget(namespace, name)
        if WATCH.recovery:
            WATCH.recovery.forget(namespace, name)
        return
    if WATCH.monitor:
        WATCH.monitor.track(namespace, name, dict(body))
    if WATCH.recovery:
        WATCH.recovery.schedule(namespace, name)
    STATUS.schedule(namespace, name, worker_pods)
