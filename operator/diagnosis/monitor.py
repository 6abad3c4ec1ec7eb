"""The watch over running jobs: every window, run the detector on each job's state; on suspicion,
queue a diagnosis (``slots.py``: a few at a time across all jobs, most severe first), write what it
finds and carry out its follow-ups (Event, remediation, alert); when the suspicion is gone long
enough, clear it.

Follow-ups are recorded on the job (``writer.py``), so a new leader finishes what the last one began
(a job it first sees with an active diagnosis whose remediation or alert is not recorded) and never
repeats what was done. Before every write the monitor checks that this replica still leads.

One asyncio task for all jobs rather than a kopf timer per job: kopf timers put a finalizer on the
resource, and rankwatch keeps jobs deletable without the operator (see handlers.py). The task runs
in the operator's event loop; the analysis runs in worker processes, API calls in threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kubernetes

from rankwatch.analysis.topology import Layout, LayoutError
from rankwatch.model.diagnosis_status import DiagnosisStatus
from rankwatch.model.finding import HUNG, Finding, FindingKind
from rankwatch.operator.config import OperatorConfig
from rankwatch.operator.diagnosis.detect.detector import Thresholds, detect
from rankwatch.operator.diagnosis.diagnose.diagnose import DiagnosisBudget, diagnose
from rankwatch.operator.diagnosis.diagnose.slots import DiagnosisSlots
from rankwatch.operator.diagnosis.diagnose.worker import WorkerFailed
from rankwatch.operator.diagnosis.ingest.collector import SecretTokens, TokenUnavailable
from rankwatch.operator.diagnosis.ingest.job_state import JobState, JobStore, StateLimits
from rankwatch.operator.diagnosis.metrics import DiagnosisMetrics
from rankwatch.operator.diagnosis.report import telemetry_watch, writer
from rankwatch.operator.diagnosis.report.job_metrics import JobMetrics
from rankwatch.operator.diagnosis.report.job_record import JobRecord, TrainingJobRecord
from rankwatch.operator.lifecycle import job_status
from rankwatch.operator.remediation import hook as remediation
from rankwatch.operator.remediation.metrics import RemediationMetrics
from rankwatch.operator.sidecar_client import SidecarPod
from rankwatch.operator.spec import InvalidSpec, TrainingJobSpec
from rankwatch.timestamps import rfc3339_now as _now

log = logging.getLogger(__name__)

TICK_S = 0.5
NO_FINDING_RETRY_S = 30.0
"""After a diagnosis that found nothing, the same kind of suspicion is looked at again this much later."""
FAILED_RETRY_S = 10.0
STEP_TIME_WRITE_S = 30.0


def _format_step(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}ms" if seconds < 10 else f"{seconds:.1f}s"


@dataclass
class WatchedJob:
    namespace: str
    name: str
    """The name the collector knows it by: a TrainingJob's own, ``<Kind>:<name>`` for a group of another kind."""
    spec: TrainingJobSpec
    layout: Layout | None
    record: JobRecord
    """Where what the monitor finds is written (the TrainingJob's status, or the group's owner)."""
    world_size_known: bool = True
    """False for a group whose pods do not say how many ranks each runs: the collector takes any rank."""
    uid: str = ""
    """The TrainingJob's uid: its pods are those it controls (see ``rankwatch.operator.ownership``)."""
    phase: str = job_status.PENDING
    status: dict[str, Any] = field(default_factory=dict)
    next_check: float = 0.0
    wanted: Finding | None = None
    """The latest suspicion, taken by the diagnosis when its slot comes (not the one that queued it)."""
    retry_after: dict[FindingKind, float] = field(default_factory=dict)
    suspected_since: dict[FindingKind, float] = field(default_factory=dict)
    clear_since: float | None = None
    telemetry_written: bool = False
    step_written: tuple[float, float] | None = None  # (value, when)
    followed_up: str | None = None
    """``status.diagnosis.time`` of the diagnosis whose follow-ups this process has carried out."""
    follow_up_after: float = 0.0
    running_since: float | None = None
    """When this process first checked the job Running (its sidecars' silence counts from here)."""
    no_telemetry: bool = False
    """The job's NoTelemetry condition is True (as its status says, or as this process wrote it)."""

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name

    @property
    def diagnosis(self) -> DiagnosisStatus | None:
        """The diagnosis its status carries, as last read or written."""
        return DiagnosisStatus.from_status(self.status)

    @property
    def thresholds(self) -> Thresholds:
        return Thresholds(float(self.spec.tracing.sensitivitySeconds), float(self.spec.tracing.windowSeconds))

    @property
    def limits(self) -> StateLimits:
        """How much state the collector may keep for the job."""
        if not self.world_size_known:
            return StateLimits(pods=2 * max(1, self.spec.replicas) + 8)
        return StateLimits.for_job(self.spec.world_size, self.spec.replicas)


class Monitor:
    """Owns the per-job watch; ``track`` / ``forget`` come from kopf handlers, ``wake`` from the collector."""

    def __init__(
        self,
        kube: kubernetes.client.ApiClient,
        store: JobStore,
        tokens: SecretTokens,
        config: OperatorConfig,
        alerts: Any = None,
        leading: Callable[[], bool] = lambda: True,
        job_metrics: JobMetrics | None = None,
        metrics: DiagnosisMetrics | None = None,
        remediation_metrics: RemediationMetrics | None = None,
    ) -> None:
        self.metrics = metrics or DiagnosisMetrics.uncounted()
        self.remediation_metrics = remediation_metrics or RemediationMetrics.uncounted()
        self.kube = kube
        self.store = store
        self.tokens = tokens
        self.sidecar_port = config.pods.sidecar_metrics_port
        self.sidecar_endpoint_hosts = config.pods.sidecar_endpoint_hosts
        limits = config.diagnosis
        self.budget = DiagnosisBudget(limits.worker_memory_bytes, limits.timeout_seconds)
        self.safeguards = config.safeguards
        self.alerts = alerts  # an AlertPipeline, when alerting is configured
        self.leading = leading
        self.slots = DiagnosisSlots(limits.concurrency, on_change=self.metrics.diagnoses_in_progress)
        self.job_metrics = job_metrics
        self.node_alerts = config.node_alerts
        self.no_telemetry_seconds = config.no_telemetry_seconds
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
            job = self.jobs[key] = WatchedJob(
                namespace, name, spec, layout, TrainingJobRecord(self.kube, namespace, name)
            )
        job.uid = str((body.get("metadata") or {}).get("uid") or "")
        if isinstance(job.record, TrainingJobRecord):
            job.record.uid = job.uid
        job.status = status
        job.phase = status.get("phase") or job_status.PENDING
        job.no_telemetry = any(
            c.get("type") == telemetry_watch.NO_TELEMETRY and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        if job.phase in job_status.TERMINAL:
            self.forget(namespace, name)

    def track_group(
        self, namespace: str, name: str, spec: TrainingJobSpec, record: JobRecord, diagnosis: DiagnosisStatus | None,
        world_size_known: bool,
    ) -> None:  # fmt: skip
        """Follow a group of another kind (``name``: its collector name) as a TrainingJob (checked once
        ``group_running`` says so): ``diagnosis`` is the one its owner carries."""
        key = (namespace, name)
        job = self.jobs.get(key)
        if job is None:
            try:
                layout = Layout(spec.parallelism.tensor, spec.parallelism.pipeline, spec.world_size)
            except LayoutError:
                layout = None
            job = self.jobs[key] = WatchedJob(namespace, name, spec, layout if world_size_known else None, record,
                                              world_size_known)  # fmt: skip
            job.status = diagnosis.to_status() if diagnosis else {}

    def group_running(self, namespace: str, name: str, running: bool) -> None:
        job = self.jobs.get((namespace, name))
        if job is not None:
            job.phase = job_status.RUNNING if running else job_status.PENDING

    def forget(self, namespace: str, name: str) -> None:
        self.jobs.pop((namespace, name), None)
        self.slots.cancel((namespace, name))
        self.store.drop(namespace, name)
        self.tokens.forget(namespace, name)

    def diagnosing(self, namespace: str, name: str) -> bool:
        """A diagnosis of the job is queued or under way (analysis, writing, alerting, cordoning)."""
        return self.slots.busy((namespace, name))

    def new_attempt(self, namespace: str, name: str, ended_pods: set[str]) -> None:
        """The job was restarted: watch its next attempt from scratch (the next job event tracks it)."""
        self.jobs.pop((namespace, name), None)
        self.slots.cancel((namespace, name))
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
        await self.slots.close()

    async def run(self) -> None:
        while True:
            now = time.monotonic()
            for job in list(self.jobs.values()):
                if not self.leading():
                    break
                try:
                    await self._follow_up_written(job, now)
                    if job.phase != job_status.RUNNING or now < job.next_check:
                        continue
                    job.next_check = now + job.spec.tracing.windowSeconds
                    await self.check(job, now)
                except Exception:  # never end the watch over every job for one job's trouble
                    log.exception("checking %s failed", job.record.label)
                # The collector shares this loop: serve the summaries that arrived while this job was
                # checked before the next (50 jobs of 1,280 ranks take ~1 s back to back).
                await asyncio.sleep(0)
            await asyncio.sleep(TICK_S)

    async def check(self, job: WatchedJob, now: float) -> None:
        state = self.store.peek(job.namespace, job.name)
        await self._watch_telemetry(job, state, now)
        if state is None or not state.summaries:
            return  # awaiting telemetry
        step = state.recent_step_time()
        if not job.telemetry_written:
            await asyncio.to_thread(job.record.write_telemetry_flowing, _now(), _format_step(step) if step else None)
            job.telemetry_written = True
            if step:
                job.step_written = (step, now)
        elif step and self._step_changed(job, step, now):
            await asyncio.to_thread(job.record.write_step_time, _format_step(step))
            job.step_written = (step, now)

        with self.metrics.detector_seconds.time():
            suspicions = detect(state, job.thresholds, job.layout, now)
        if self.job_metrics is not None:
            self.job_metrics.judged(job.namespace, job.name)
        kinds = {s.kind for s in suspicions}
        for kind in kinds - set(job.suspected_since):
            self.metrics.suspicions.labels(kind.value).inc()
            job.suspected_since[kind] = now
        for kind in set(job.suspected_since) - kinds:
            del job.suspected_since[kind]
        active = writer.active_condition(job.status)
        hang = next((s for s in suspicions if s.kind is FindingKind.HANG), None)
        if active == HUNG:
            if hang is not None:
                job.clear_since = None  # a hung job stays hung until it moves
            else:
                await self._maybe_recovered(job, active, now)
            return
        if suspicions:
            job.clear_since = None
            suspicion = suspicions[0]
            if active == suspicion.kind.condition and self._already_reported(job, suspicion):
                return  # the job already says so
            job.wanted = suspicion
            if now >= job.retry_after.get(suspicion.kind, 0):
                self.slots.request(job.key, suspicion.kind.severity, lambda: self._diagnose(job))
            return
        job.wanted = None
        if active is None:
            job.clear_since = None
            return
        await self._maybe_recovered(job, active, now)

    async def _watch_telemetry(self, job: WatchedJob, state: JobState | None, now: float) -> None:
        """Say ``NoTelemetry`` on a running job whose sidecars ship nothing, and take it back."""
        if job.running_since is None:
            job.running_since = now
        shipped = state is not None and state.summaries > 0
        silent_s = now - (state.last_seen if shipped else job.running_since)
        silent = silent_s >= telemetry_watch.silence_limit(self.no_telemetry_seconds, job.spec.tracing.windowSeconds)
        if silent == job.no_telemetry:
            return
        message = telemetry_watch.describe_silence(silent_s, time.time() - silent_s, shipped, job.spec.replicas)
        if silent:
            log.warning("%s: %s", job.record.label, message)
        await asyncio.to_thread(job.record.write_no_telemetry, silent, message, _now())
        job.no_telemetry = silent

    async def _maybe_recovered(self, job: WatchedJob, active: str, now: float) -> None:
        """Clear the finding once the suspicion has been gone for a few windows."""
        job.clear_since = job.clear_since or now
        window = job.spec.tracing.windowSeconds
        needed = max(3 * window, 15.0) if active == HUNG else max(6 * window, 30.0)
        if now - job.clear_since < needed:
            return
        why = (
            "collectives complete again on every communicator"
            if active == HUNG
            else f"no rank out of line and step time at baseline for {now - job.clear_since:.0f} s"
        )
        written = await asyncio.to_thread(job.record.write_recovered, why, _now())
        if written is not None:
            kind = job.diagnosis.reason if job.diagnosis else "unknown"
            self.metrics.recoveries.labels(kind).inc()
            log.info("%s recovered: %s", job.record.label, why)
            if self.alerts is not None:
                await self.alerts.resolve(labels=job.record.alert_labels)
        if job.diagnosis is not None:
            job.status = {**job.status, **job.diagnosis.inactive().to_status()}
        job.clear_since = None

    @staticmethod
    def _already_reported(job: WatchedJob, suspicion: Finding) -> bool:
        ranks = set(job.diagnosis.ranks) if job.diagnosis else set()
        return not suspicion.ranks or set(suspicion.ranks) <= ranks or suspicion.kind is FindingKind.FAIL_SLOW

    @staticmethod
    def _step_changed(job: WatchedJob, step: float, now: float) -> bool:
        if job.step_written is None:
            return True
        value, when = job.step_written
        return now - when >= STEP_TIME_WRITE_S and abs(step - value) > 0.05 * value

    # -- diagnosis -------------------------------------------------------------------------------------
    async def _diagnose(self, job: WatchedJob) -> None:
        suspicion, job.wanted = job.wanted, None
        if suspicion is None or self.jobs.get(job.key) is not job:
            return  # the job recovered, finished or went while it waited
        started = time.monotonic()
        suspected = job.suspected_since.get(suspicion.kind, started)
        log.warning("%s: %s; diagnosing", job.record.label, suspicion.summary)
        try:
            pods = await asyncio.to_thread(self._pods, job)
            token = await self.tokens(job.namespace, job.name)
            if token is None:
                raise TokenUnavailable(f"no token Secret for {job.record.label}")
            state = self.store.get(job.namespace, job.name)
            window = job.thresholds.window_s
            diagnosis, examination = await diagnose(
                state,
                suspicion,
                job.layout,
                pods,
                token,
                job.thresholds.sensitivity_s,
                window,
                self.budget,
                self.node_alerts,
            )
        except asyncio.CancelledError:
            raise
        except WorkerFailed as error:
            self.metrics.diagnoses.labels(error.reason).inc()
            log.error("diagnosis of %s failed: %s", job.record.label, error)
            job.retry_after[suspicion.kind] = time.monotonic() + NO_FINDING_RETRY_S
            return
        except Exception:
            self.metrics.diagnoses.labels("failed").inc()
            log.exception("diagnosis of %s failed", job.record.label)
            job.retry_after[suspicion.kind] = time.monotonic() + FAILED_RETRY_S
            return
        self.metrics.diagnosis_peak_bytes.observe(examination.peak_rss_bytes)
        if diagnosis is None:
            self.metrics.diagnoses.labels("no_finding").inc()
            reachable = examination.pods_answered > 0  # no sidecar answered: asking again at once will not help
            quick = suspicion.kind is FindingKind.HANG and reachable  # a hang's evidence grows with time
            retry = job.thresholds.window_s * 2 if quick else NO_FINDING_RETRY_S
            job.retry_after[suspicion.kind] = time.monotonic() + retry
            log.info(
                "%s: the analysis found nothing behind %r (problems: %s); looking again in %.0f s",
                job.record.label,
                suspicion.summary,
                "; ".join(examination.report.problems) or "none",
                retry,
            )
            return
        self.metrics.diagnoses.labels("finding").inc()
        if not self.leading():
            return
        written = await asyncio.to_thread(job.record.write_diagnosis, diagnosis, _now())
        if written is None:
            log.info("%s already carries %s on %s", job.record.label, diagnosis.finding.reason,
                     sorted(diagnosis.finding.nodes))  # fmt: skip
            return
        elapsed = time.monotonic() - started
        if self.job_metrics is not None:
            self.job_metrics.detected(job.namespace, job.name, diagnosis.finding.kind.value)
        self.metrics.diagnosis_seconds.observe(elapsed)
        log.warning(
            "%s: %s (diagnosed in %.1f s, %.1f s after the first suspicion)",
            job.record.label,
            diagnosis.finding.summary,
            elapsed,
            time.monotonic() - suspected,
        )
        job.status = written["status"]
        job.clear_since = None
        await self._follow_up(job, written, diagnosis.finding)

    # -- follow-ups ------------------------------------------------------------------------------------
    async def _follow_up_written(self, job: WatchedJob, now: float) -> None:
        """Finish the follow-ups of a diagnosis this process did not write (a previous leader did)."""
        diagnosis = job.diagnosis
        if (
            self.slots.busy(job.key)  # its own diagnosis carries out what it writes
            or job.followed_up == (diagnosis.time if diagnosis else None)
            or now < job.follow_up_after
            or not writer.pending_follow_ups(job.status, self.alerts is not None)
        ):
            return
        job.follow_up_after = now + FAILED_RETRY_S
        body = await asyncio.to_thread(job.record.read)
        if body is None:
            return
        status = body.get("status") or {}
        written = DiagnosisStatus.from_status(status)
        if written is None or not written.pending(self.alerts is not None):
            job.status, job.followed_up = status, (written.time if written else None)
            return
        time_ = written.time
        finding = await asyncio.to_thread(job.record.stored_finding, time_)
        if finding is None:
            log.warning("%s: the finding of the diagnosis of %s is gone; its follow-ups are not carried out",
                        job.record.label, time_)  # fmt: skip
            job.followed_up = time_
            return
        log.info("%s: finishing the follow-ups of the diagnosis of %s (%s)", job.record.label, time_,
                 ", ".join(written.pending(self.alerts is not None)))  # fmt: skip
        await asyncio.to_thread(job.record.post_diagnosis_event, body, written)
        await self._follow_up(job, body, finding)

    async def _follow_up(self, job: WatchedJob, body: dict[str, Any], finding: Finding) -> None:
        """Remediation and the alert of the diagnosis in ``body``'s status, each unless recorded done."""
        status = body.get("status") or {}
        diagnosis = DiagnosisStatus.from_status(status)
        time_ = diagnosis.time if diagnosis else ""
        pending = writer.pending_follow_ups(status, self.alerts is not None)
        done = True
        if writer.REMEDIATION in pending and self.leading():
            try:
                result = await job.record.remediate(body, finding, self.safeguards, self.remediation_metrics)
            except Exception:
                log.exception("remediation of %s (%s on %s) failed; retrying", job.record.label, finding.reason,
                              finding.nodes)  # fmt: skip
                done = False
            else:
                await asyncio.to_thread(job.record.record_follow_up, time_, writer.REMEDIATION,
                                        remediation.outcome_text(result))  # fmt: skip
        if writer.ALERTED in pending and self.leading():
            try:
                await self._alert(job, finding)
            except Exception:
                log.exception("alerting for %s failed; retrying", job.record.label)
                done = False
            else:
                await asyncio.to_thread(job.record.record_follow_up, time_, writer.ALERTED, _now())
        if done:
            job.followed_up = time_

    async def _alert(self, job: WatchedJob, finding: Finding) -> None:
        await self.alerts.submit([job.record.alert(finding, job.spec)])

    def _pods(self, job: WatchedJob) -> list[SidecarPod]:
        return [SidecarPod.from_pod(pod, self.sidecar_port, self.sidecar_endpoint_hosts) for pod in job.record.pods()]
