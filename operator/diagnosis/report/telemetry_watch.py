"""``NoTelemetry``: a running job whose sidecars have shipped nothing for a while says so.

Every sidecar ships a window summary each ``tracing.windowSeconds``, with or without NCCL calls, so
silence from all of them means the sidecars cannot reach the collector (a NetworkPolicy, a wrong
collector URL, a sidecar that cannot start) and rankwatch sees nothing of the job: without this the
job would sit at ``Health: Unknown / AwaitingTelemetry`` for ever. The condition is True after
``silence_limit`` without a summary (since the job runs, or since the last one), False again once
summaries arrive; each change is an Event on the job, and ``rankwatch_job_condition{condition=
"NoTelemetry"}`` carries it to the chart's rule ``RankwatchJobNoTelemetry``.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch.model import event_reasons
from rankwatch.operator import events
from rankwatch.operator.lifecycle import job_status
from rankwatch.operator.lifecycle.status_patch import update_status
from rankwatch.timestamps import rfc3339

log = logging.getLogger(__name__)

NO_TELEMETRY = "NoTelemetry"
WINDOWS_OF_SILENCE = 3
"""A job whose windows are longer than a third of the setting gets this many windows of silence."""


def silence_limit(no_telemetry_seconds: float, window_seconds: float) -> float:
    """How long a running job's sidecars may ship nothing before the job says ``NoTelemetry``."""
    return max(no_telemetry_seconds, WINDOWS_OF_SILENCE * window_seconds)


def describe_silence(silent_s: float, since_wall: float, shipped_before: bool, replicas: int) -> str:
    since = rfc3339(datetime.datetime.fromtimestamp(since_wall, datetime.UTC))
    what = "since the last one" if shipped_before else "since the job started running"
    return (
        f"no window summary from any of the job's {replicas} sidecars for {silent_s:.0f} s ({what}, {since}): "
        "rankwatch sees nothing of this job. Check `kubectl logs <worker pod> -c rankwatch-sidecar` and that "
        "the sidecars reach the operator's collector Service (NetworkPolicy, RANKWATCH_COLLECTOR_URL)"
    )


def write(kube: kubernetes.client.ApiClient, namespace: str, name: str, silent: bool, message: str, now: str) -> bool:
    """Set the condition (True: ``silent``); a job that never had it is left alone while it ships.
    True if the condition changed (then an Event says so). Blocking."""

    def change(job: dict[str, Any]) -> dict[str, Any] | None:
        status = job.get("status") or {}
        if status.get("phase") != job_status.RUNNING:
            return None
        conditions = list(status.get("conditions") or [])
        current = next((c for c in conditions if c.get("type") == NO_TELEMETRY), None)
        wanted = "True" if silent else "False"
        if (current is None and not silent) or (current is not None and current.get("status") == wanted):
            return None
        reason = "NoSummaries" if silent else "SummariesArriving"
        text = message if silent else "window summaries arrive from the sidecars again"
        generation = job["metadata"].get("generation", 1)
        return {"conditions": job_status.set_condition(conditions, NO_TELEMETRY, wanted, reason, text, now, generation)}

    written = update_status(namespace, name, kube=kube, change=change)
    if written is None:
        return False
    job, _ = written
    try:
        events.post_event(
            kube,
            events.EventTarget.job(namespace, name, job["metadata"]["uid"]),
            type="Warning" if silent else "Normal",
            reason=event_reasons.NO_TELEMETRY if silent else event_reasons.TELEMETRY_RESUMED,
            message=message if silent else "window summaries arrive from the sidecars again",
            key=f"{NO_TELEMETRY}/{silent}/{now}",
            repeat=False,
            now=datetime.datetime.now(datetime.UTC),
        )
    except ApiException as error:
        log.warning("Event %s on TrainingJob %s/%s not posted: HTTP %s", NO_TELEMETRY, namespace, name, error.status)
    return True
