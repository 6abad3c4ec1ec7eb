"""The watch over running jobs: every window, run the detector on each job's state; on suspicion,
diagnose (one diagnosis at a time per job) and write the result; when the suspicion is gone long
enough, clear it.

One asyncio task for all jobs rather than a kopf timer per job: kopf timers put a finalizer on the
resource, and rankwatch keeps jobs deletable without the operator (see handlers.py). The task is
started with the collector, in the operator's event loop; everything blocking runs in threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import kubernetes

from rankwatch.analysis.findings import Finding
from rankwatch.analysis.topology import Layout, LayoutError
from rankwatch.operator import api
from rankwatch.operator.diagnosis import metrics
from rankwatch.operator.diagnosis import writer as diagnosis_writer
from rankwatch.operator.diagnosis.collector import SecretTokens, TokenUnavailable
from rankwatch.operator.diagnosis.detector import Suspicion, Thresholds, detect
from rankwatch.operator.diagnosis.diagnose import Diagnosis, SidecarPod, diagnose
from rankwatch.operator.diagnosis.job_state import JobStore
from rankwatch.operator.lifecycle import job_status
from rankwatch.operator.remediation import hook as remediation_hook
from rankwatch.operator.spec import InvalidSpec, TrainingJobSpec

log = logging.getLogger(__name__)

TICK_S = 0.5
NO_FINDING_RETRY_S = 30.0
"""After a diagnosis that found nothing, the same kind of suspicion is looked at again this much later."""
FAILED_RETRY_S = 10.0
STEP_TIME_WRITE_S = 30.0


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _condition_of(suspicion: Suspicion) -> str:
    return "Hung" if suspicion.kind == "hang" else "Degraded"


def _format_step(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}ms" if seconds < 10 else f"{seconds:.1f}s"


@dataclass
class WatchedJob:
    namespace: str
    name: str
    spec: TrainingJobSpec
    layout: Layout | None
    phase: str = job_status.PENDING
    status: dict[str, Any] = field(default_factory=dict)
    next_check: float = 0.0
    diagnosing: asyncio.Task[None] | None = None
    retry_after: dict[str, float] = field(default_factory=dict)
    suspected_since: dict[str, float] = field(default_factory=dict)
    clear_since: float | None = None
    telemetry_written: bool = False
    step_written: tuple[float, float] | None = None  # (value, when)

    @property
    def thresholds(self) -> Thresholds:
        return Thresholds(float(self.spec.tracing.sensitivitySeconds), float(self.spec.tracing.windowSeconds))


class Monitor:
    """Owns the per-job watch; ``track`` / ``forget`` come from kopf handlers, ``wake`` from the collector."""

    def __init__(self, store: JobStore, tokens: SecretTokens, sidecar_port: int, alerts: Any = None) -> None:
        self.store = store
        self.tokens = tokens
        self.sidecar_port = sidecar_port
        self.alerts = alerts  # an AlertPipeline, when alerting is configured
        self.jobs: dict[tuple[str, str], WatchedJob] = {}
        self._task: asyncio.Task[None] | None = None

    # -- from the handlers ---------------------------------------------------------------------------
    def track(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        status = dict(body.get("status") or {})
        key = (namespace, name)
        job = self.jobs.get(key)
        if job is None:
            try:
                spec = TrainingJobSpec.from_manifest(dict(body.get("spec") or {}))
            except InvalidSpec:
                return
            if not spec.tracing.enabled:
                return
            try:
                layout = Layout(spec.parallelism.tensor, spec.parallelism.pipeline, spec.world_size)
            except LayoutError:
                layout = None
            job = self.jobs[key] = WatchedJob(namespace, name, spec, layout)
        job.status = status
        job.phase = status.get("phase") or job_status.PENDING
        if job.phase in job_status.TERMINAL:
            self.forget(namespace, name)

    def forget(self, namespace: str, name: str) -> None:
        job = self.jobs.pop((namespace, name), None)
        if job and job.diagnosing and not job.diagnosing.done():
            job.diagnosing.cancel()
        self.store.drop(namespace, name)
        self.tokens.forget(namespace, name)

    def diagnosing(self, namespace: str, name: str) -> bool:
        """A diagnosis of the job is under way (analysis, writing, alerting, cordoning)."""
        job = self.jobs.get((namespace, name))
        return bool(job and job.diagnosing and not job.diagnosing.done())

    def new_attempt(self, namespace: str, name: str, ended_pods: set[str]) -> None:
        """The job was restarted: watch its next attempt from scratch (the next job event tracks it)."""
        job = self.jobs.pop((namespace, name), None)
        if job and job.diagnosing and not job.diagnosing.done():
            job.diagnosing.cancel()
        self.store.new_attempt(namespace, name, ended_pods)

    def wake(self, namespace: str, name: str) -> None:
        """A stall report arrived: check the job now rather than at its next window."""
        job = self.jobs.get((namespace, name))
        if job is not None:
            job.next_check = 0.0

    # -- the loop ------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="rankwatch-monitor")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for job in self.jobs.values():
            if job.diagnosing and not job.diagnosing.done():
                job.diagnosing.cancel()

    async def run(self) -> None:
        while True:
            now = time.monotonic()
            for job in list(self.jobs.values()):
                if job.phase != job_status.RUNNING or now < job.next_check:
                    continue
                job.next_check = now + job.spec.tracing.windowSeconds
                try:
                    await self.check(job, now)
                except Exception:  # never end the watch over every job for one job's trouble
                    log.exception("checking TrainingJob %s/%s failed", job.namespace, job.name)
            await asyncio.sleep(TICK_S)

    async def check(self, job: WatchedJob, now: float) -> None:
        state = self.store.peek(job.namespace, job.name)
        if state is None or not state.summaries:
            return  # awaiting telemetry
        step = self._step_time(state)
        if not job.telemetry_written:
            await asyncio.to_thread(
                diagnosis_writer.write_telemetry_flowing,
                job.namespace,
                job.name,
                _now(),
                _format_step(step) if step else None,
            )
            job.telemetry_written = True
            if step:
                job.step_written = (step, now)
        elif step and self._step_changed(job, step, now):
            await asyncio.to_thread(diagnosis_writer.write_step_time, job.namespace, job.name, _format_step(step))
            job.step_written = (step, now)

        suspicions = detect(state, job.thresholds, job.layout, now)
        kinds = {s.kind for s in suspicions}
        for kind in kinds - set(job.suspected_since):
            metrics.SUSPICIONS.labels(kind).inc()
            job.suspected_since[kind] = now
        for kind in set(job.suspected_since) - kinds:
            del job.suspected_since[kind]
        active = diagnosis_writer.active_condition(job.status)
        hang = next((s for s in suspicions if s.kind == "hang"), None)
        if active == "Hung":
            if hang is not None:
                job.clear_since = None  # a hung job stays hung until it moves
            else:
                await self._maybe_recovered(job, active, now)
            return
        if suspicions:
            job.clear_since = None
            suspicion = suspicions[0]
            if active == _condition_of(suspicion) and self._already_reported(job, suspicion):
                return  # the job already says so
            if (job.diagnosing is None or job.diagnosing.done()) and now >= job.retry_after.get(suspicion.kind, 0):
                job.diagnosing = asyncio.create_task(self._diagnose(job, suspicion))
            return
        if active is None:
            job.clear_since = None
            return
        await self._maybe_recovered(job, active, now)

    async def _maybe_recovered(self, job: WatchedJob, active: str, now: float) -> None:
        """Clear the finding once the suspicion has been gone for a few windows."""
        job.clear_since = job.clear_since or now
        window = job.spec.tracing.windowSeconds
        needed = max(3 * window, 15.0) if active == "Hung" else max(6 * window, 30.0)
        if now - job.clear_since < needed:
            return
        why = (
            "collectives complete again on every communicator"
            if active == "Hung"
            else f"no rank out of line and step time at baseline for {now - job.clear_since:.0f} s"
        )
        written = await asyncio.to_thread(diagnosis_writer.write_recovered, job.namespace, job.name, why, _now())
        if written is not None:
            kind = (job.status.get("diagnosis") or {}).get("kind", "unknown")
            metrics.RECOVERIES.labels(kind).inc()
            log.info("TrainingJob %s/%s recovered: %s", job.namespace, job.name, why)
            if self.alerts is not None:
                await self.alerts.resolve(labels={"namespace": job.namespace, "trainingjob": job.name})
        job.status = {**job.status, "diagnosis": {**(job.status.get("diagnosis") or {}), "active": False}}
        job.clear_since = None

    @staticmethod
    def _already_reported(job: WatchedJob, suspicion: Suspicion) -> bool:
        ranks = set((job.status.get("diagnosis") or {}).get("ranks") or [])
        return not suspicion.ranks or set(suspicion.ranks) <= ranks or suspicion.kind == "slowdown"

    @staticmethod
    def _step_time(state: Any) -> float | None:
        recent = [value for _, value in list(state.step_times)[-8:]]
        if not recent:
            return None
        return sorted(recent)[len(recent) // 2]

    @staticmethod
    def _step_changed(job: WatchedJob, step: float, now: float) -> bool:
        if job.step_written is None:
            return True
        value, when = job.step_written
        return now - when >= STEP_TIME_WRITE_S and abs(step - value) > 0.05 * value

    # -- diagnosis -------------------------------------------------------------------------------------
    async def _diagnose(self, job: WatchedJob, suspicion: Suspicion) -> None:
        try:
            await self._diagnose_and_write(job, suspicion)
        except asyncio.CancelledError:
            raise
        except Exception:  # a task's exception would otherwise vanish unseen
            metrics.DIAGNOSES.labels("failed").inc()
            log.exception("diagnosis of TrainingJob %s/%s failed", job.namespace, job.name)
            job.retry_after[suspicion.kind] = time.monotonic() + FAILED_RETRY_S

    async def _diagnose_and_write(self, job: WatchedJob, suspicion: Suspicion) -> None:
        started = time.monotonic()
        suspected = job.suspected_since.get(suspicion.kind, started)
        log.warning("TrainingJob %s/%s: %s; diagnosing", job.namespace, job.name, suspicion.summary)
        try:
            pods = await asyncio.to_thread(self._pods, job)
            token = await self.tokens(job.namespace, job.name)
            if token is None:
                raise TokenUnavailable(f"no Secret {api.token_secret_name(job.name)}")
            state = self.store.get(job.namespace, job.name)
            diagnosis, report = await diagnose(
                state,
                suspicion,
                job.layout,
                pods,
                token,
                job.thresholds.sensitivity_s,
                job.thresholds.window_s,
            )
        except asyncio.CancelledError:
            raise
        except Exception:
            metrics.DIAGNOSES.labels("failed").inc()
            log.exception("diagnosis of TrainingJob %s/%s failed", job.namespace, job.name)
            job.retry_after[suspicion.kind] = time.monotonic() + FAILED_RETRY_S
            return
        if diagnosis is None:
            metrics.DIAGNOSES.labels("no_finding").inc()
            unreachable = "pods_asked" not in report  # no sidecar answered: asking again at once will not help
            quick = suspicion.kind == "hang" and not unreachable  # a hang's evidence grows with time
            retry = job.thresholds.window_s * 2 if quick else NO_FINDING_RETRY_S
            job.retry_after[suspicion.kind] = time.monotonic() + retry
            log.info(
                "TrainingJob %s/%s: the analysis found nothing behind %r (problems: %s); looking again in %.0f s",
                job.namespace,
                job.name,
                suspicion.summary,
                "; ".join(report.get("problems") or []) or "none",
                retry,
            )
            return
        metrics.DIAGNOSES.labels("finding").inc()
        written = await asyncio.to_thread(diagnosis_writer.write_diagnosis, job.namespace, job.name, diagnosis, _now())
        if written is None:
            log.info(
                "TrainingJob %s/%s already carries %s on %s", job.namespace, job.name, diagnosis.kind, diagnosis.nodes
            )
        else:
            elapsed = time.monotonic() - started
            metrics.DETECTIONS.labels(diagnosis.finding["kind"]).inc()
            metrics.DIAGNOSIS_SECONDS.observe(elapsed)
            log.warning(
                "TrainingJob %s/%s: %s (diagnosed in %.1f s, %.1f s after the first suspicion)",
                job.namespace,
                job.name,
                diagnosis.summary,
                elapsed,
                time.monotonic() - suspected,
            )
            await self._alert(job, diagnosis)
            await remediation_hook.remediate(written, diagnosis)
        job.status = {
            **job.status,
            "diagnosis": {"active": True, "kind": diagnosis.kind, "ranks": diagnosis.ranks},
        }
        job.clear_since = None

    def _pods(self, job: WatchedJob) -> list[SidecarPod]:
        pods = kubernetes.client.CoreV1Api().list_namespaced_pod(
            job.namespace, label_selector=f"{api.JOB_NAME_LABEL}={job.name}"
        )
        client = kubernetes.client.ApiClient()
        return [
            SidecarPod.from_pod(client.sanitize_for_serialization(pod), self.sidecar_port)
            for pod in pods.items
            if not pod.metadata.deletion_timestamp
        ]

    async def _alert(self, job: WatchedJob, diagnosis: Diagnosis) -> None:
        if self.alerts is None:
            return
        from rankwatch.alerting import alert_from_finding

        try:
            finding = Finding(**{key: diagnosis.finding[key] for key in Finding.__dataclass_fields__})
            await self.alerts.submit([alert_from_finding(job.namespace, job.name, finding, job.spec.alerting)])
        except Exception:
            log.exception("alerting for TrainingJob %s/%s failed", job.namespace, job.name)
