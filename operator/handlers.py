"""kopf handlers: the lifecycle of a TrainingJob, kept thin; the work is in the modules they call.

startup        -> kopf's settings; the leader's watch (collector, monitor, recovery, alerting: ``watch.py``)
create/resume  -> create the token Secret, the headless Service and the worker Pods (``lifecycle/``)
pod/job events -> derive the status from the worker pods (kept in a kopf index, no API lists), post
                  Events on transitions, recreate pods lost before the job started; job events tell
                  the monitor which jobs run and recovery which jobs to look at
pod admission  -> the webhook injects opted-in pods of other kinds (``kinds/webhook.py``); those that
                  start without it are reported on their group (``kinds/unwatched.py``); injected ones
                  enter the monitor's loop (``kinds/group_watch.py``)
node events    -> the annotation-driven undo of a cordon (``remediation/node_handlers.py``); the
                  per-job series of /metrics (``diagnosis/report/job_metrics.py``) follow the jobs' status,
                  their pods and rankwatch's cordons; a deleted job's series go

kopf runs only on the replica that holds the Lease (``main.py``); what it needs comes in ``memo``:
``config`` (the validated :class:`OperatorConfig`), ``kube`` (the API client), ``leading`` (is the
Lease still held).
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

import rankwatch.operator.remediation.node_handlers  # noqa: F401  (registers the Node handler: undo by annotation)
from rankwatch import tenant_text
from rankwatch.kube import api_client
from rankwatch.model import event_reasons
from rankwatch.operator import api
from rankwatch.operator.config import OperatorConfig
from rankwatch.operator.kinds import (
    group_watch,
    restart_indexed_job,
    restart_pytorchjob,
    restart_trainjob,
    unwatched,
    webhook,
)
from rankwatch.operator.lifecycle import children, job_status
from rankwatch.operator.lifecycle.status_sync import StatusSync
from rankwatch.operator.operator_metrics import OperatorMetrics
from rankwatch.operator.pause_metrics import PauseMetrics
from rankwatch.operator.remediation import node_marks
from rankwatch.operator.spec import InvalidSpec, TrainingJobSpec
from rankwatch.operator.watch import Watch
from rankwatch.timestamps import rfc3339_now

JOBS = (api.GROUP, api.VERSION, api.PLURAL)
WATCH_SECONDS = 300
"""The API server ends each of kopf's watches after this long; kopf opens it again."""


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=api.GROUP, key="last-handled-configuration"
    )
    # Handler log lines stay in the operator's log; Events are posted explicitly, for people.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "rankwatch-operator"
    if "config" not in memo:  # `kopf run -m rankwatch.operator.handlers` (the e2e tests' in-process operator)
        memo.config = OperatorConfig.from_env(standalone=True)
        memo.kube = api_client(request_timeout=memo.config.api_timeout_seconds)
        memo.leading = lambda: True
    # No call of kopf's may wait forever on a connection a partition holds open (see api_timeout_seconds).
    timeout = memo.config.api_timeout_seconds
    settings.networking.request_timeout = settings.networking.connect_timeout = timeout
    settings.watching.server_timeout = WATCH_SECONDS
    settings.watching.client_timeout = WATCH_SECONDS + timeout
    settings.watching.connect_timeout = timeout
    settings.admission.server = webhook.admission_server(memo.config.webhook)
    memo.status_sync = StatusSync(memo.kube, memo.config)
    memo.metrics = OperatorMetrics.of()  # the process's series (made on the first start)
    diagnosis_metrics = memo.metrics.diagnosis
    memo.pauses = PauseMetrics(diagnosis_metrics.event_loop_lag_seconds, diagnosis_metrics.gc_pause_seconds)
    memo.pauses.start()
    memo.unwatched = unwatched.UnwatchedPods(memo.kube, memo.metrics.diagnosis.unwatched_pods)
    memo.group_pods = group_watch.GroupPods(memo.kube)
    if memo.config.webhook.listen is not None:
        restart_indexed_job.watch_suspended_jobs()  # an Indexed Job suspended to restart it is resumed
        restart_trainjob.watch_suspended_trainjobs()  # and a TrainJob
        restart_pytorchjob.watch_suspended_pytorchjobs()  # and a PyTorchJob
    memo.groups_with_token = webhook.GroupsWithToken()
    memo.trainjob_of_jobset = webhook.TrainJobOfJobSet()
    memo.watch = Watch(memo.config, memo.kube, memo.leading, memo.metrics)
    await memo.watch.start()


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    if "watch" in memo:
        await memo.watch.stop()
    if "pauses" in memo:
        await memo.pauses.stop()


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod: its ServiceAccount; elsewhere: $KUBECONFIG as it is now (not at import time)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.index("pods", labels={api.JOB_NAME_LABEL: kopf.PRESENT})
def worker_pods(namespace: str, labels: dict[str, str], body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, labels[api.JOB_NAME_LABEL]): job_status.WorkerPod.from_pod(body)}


def _fail(body: kopf.Body, patch: kopf.Patch, reason: str, message: str, generation: int) -> None:
    """A job that cannot be run: Failed at once, with the reason on the status and as an Event."""
    moment = rfc3339_now()
    conditions = list(body.get("status", {}).get("conditions") or [])
    conditions = job_status.set_condition(conditions, "Failed", "True", reason, message, moment, generation)
    patch.status.update(phase=job_status.FAILED, message=message, conditions=conditions, completionTime=moment)
    kopf.event(body, type="Warning", reason=reason, message=tenant_text.one_line(message))


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
    memo: kopf.Memo,
    **_: Any,
) -> None:
    if status.get("phase") in job_status.TERMINAL:
        return
    generation = body["metadata"].get("generation", 1)
    try:
        job_spec = TrainingJobSpec.from_manifest(dict(spec))
        existing = {pod.name for pod in worker_pods.get((namespace, name), [])}
        created = children.ensure_children(memo.kube, dict(body), job_spec, memo.config.pods, existing)
    except InvalidSpec as error:
        _fail(body, patch, event_reasons.INVALID_SPEC, str(error), generation)
        return
    except children.NameConflict as error:
        _fail(body, patch, event_reasons.NAME_CONFLICT, str(error), generation)
        return
    if created:
        message = tenant_text.one_line(f"created {', '.join(created)}")
        kopf.event(body, type="Normal", reason=event_reasons.CREATED, message=message)
    if not status.get("conditions"):
        patch.status.update(
            phase=job_status.SUSPENDED if job_spec.suspend else job_status.PENDING,
            health="Unknown",
            workers=f"0/{job_spec.replicas}",
            conditions=job_status.initial_conditions(job_spec, rfc3339_now(), generation),
        )


@kopf.on.event("pods", labels={api.JOB_NAME_LABEL: kopf.PRESENT})
async def pod_changed(
    namespace: str, labels: dict[str, str], worker_pods: kopf.Index, memo: kopf.Memo, **_: Any
) -> None:
    job = labels[api.JOB_NAME_LABEL]
    memo.status_sync.schedule(namespace, job, worker_pods)
    if memo.watch.job_metrics:
        memo.watch.job_metrics.observe_pods(
            namespace, job, (pod.name for pod in worker_pods.get((namespace, job), []) if not pod.deleting)
        )


@kopf.on.event(*JOBS)
async def job_changed(
    namespace: str, name: str, type: str | None, body: kopf.Body, worker_pods: kopf.Index, memo: kopf.Memo, **_: Any
) -> None:
    monitor, recovery, job_metrics = memo.watch.monitor, memo.watch.recovery, memo.watch.job_metrics
    if type == "DELETED":
        if monitor:
            monitor.forget(namespace, name)
        if recovery:
            recovery.forget(namespace, name)
        if job_metrics:
            job_metrics.forget(namespace, name)
        return
    if job_metrics:
        job_metrics.observe(namespace, name, body.get("status") or {})
    if monitor:
        monitor.track(namespace, name, dict(body))
    if recovery:
        recovery.schedule(namespace, name)
    memo.status_sync.schedule(namespace, name, worker_pods)


def _cordon_news(name: str, annotations: kopf.Annotations, memo: kopf.Memo, **_: Any) -> bool:
    """A node rankwatch marked, or one it counted: the others' status updates need no handler (nor a log line)."""
    job_metrics = memo.watch.job_metrics if "watch" in memo else None
    counted = job_metrics is not None and name in job_metrics.cordoned
    return counted or node_marks.CORDONED_BY in annotations


@kopf.on.event("nodes", when=_cordon_news)
async def node_changed(name: str, type: str | None, annotations: kopf.Annotations, memo: kopf.Memo, **_: Any) -> None:
    """Counts rankwatch's cordons for /metrics (kopf watches the nodes anyway, for the undo handler)."""
    if memo.watch.job_metrics:
        memo.watch.job_metrics.observe_node(name, dict(annotations), deleted=type == "DELETED")
