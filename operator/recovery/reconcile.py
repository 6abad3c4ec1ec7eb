"""Recovery, driven by the job's own status: after each job event (and at the times it asked to be
woken), decide what to do about the job (``decision.decide``) and do it: keep the evidence, end the
attempt, start the next one away from the suspects, or fail the job after ``maxRestarts``.

One task per job at a time, in the operator's event loop; every Kubernetes and S3 call runs in a
worker thread. Nothing is kept in memory that the status does not also say, so a restarted operator
picks up where the last one stopped (a restart whose status was written but whose pods were not yet
deleted or created is finished by the next reconcile).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch import tenant_text
from rankwatch.analysis.topology import Layout, LayoutError
from rankwatch.model import event_reasons
from rankwatch.model.diagnosis_status import DiagnosisStatus, key_of
from rankwatch.model.evidence import slowdown_of
from rankwatch.operator import api, events
from rankwatch.operator.config import OperatorConfig
from rankwatch.operator.diagnosis.ingest.collector import SecretTokens, TokenUnavailable
from rankwatch.operator.lifecycle import children, job_status
from rankwatch.operator.recovery import archive, archive_endpoints, attempts, evidence
from rankwatch.operator.recovery.decision import (
    SLOWDOWN_KINDS,
    WORKER_FAILED,
    Action,
    Verdict,
    decide,
    parse_time,
)
from rankwatch.operator.sidecar_client import SidecarPod
from rankwatch.operator.spec import InvalidSpec, TrainingJobSpec
from rankwatch.timestamps import rfc3339_now

log = logging.getLogger(__name__)

RETRY_S = 10.0


@dataclass(frozen=True)
class Kept:
    """Where an archive went (``path`` empty when it was not kept) and what went wrong on the way."""

    path: str
    problems: tuple[str, ...]


def _read_job(kube: kubernetes.client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return kubernetes.client.CustomObjectsApi(kube).get_namespaced_custom_object(
            api.GROUP, api.VERSION, namespace, api.PLURAL, name
        )
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def _report(kube: kubernetes.client.ApiClient, namespace: str, name: str | None) -> dict[str, str] | None:
    if not name:
        return None
    try:
        return kubernetes.client.CoreV1Api(kube).read_namespaced_config_map(name, namespace).data or {}
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def _slowdown(kube: kubernetes.client.ApiClient, namespace: str, status: dict[str, Any]) -> float | None:
    """The active straggler / fail-slow finding's measured slowdown, from its report."""
    diagnosis = DiagnosisStatus.from_status(status)
    if diagnosis is None or diagnosis.kind not in SLOWDOWN_KINDS:
        return None
    report = _report(kube, namespace, diagnosis.report) or {}
    try:
        findings = json.loads(report.get("report.json") or "{}").get("findings") or []
    except ValueError:
        return None
    for finding in findings:
        if sorted(finding.get("ranks") or []) == sorted(diagnosis.ranks):
            return slowdown_of(finding.get("evidence") or {})
    return None


def _layout(spec: TrainingJobSpec) -> Layout | None:
    try:
        return Layout(spec.parallelism.tensor, spec.parallelism.pipeline, spec.world_size)
    except LayoutError:
        return None


class Recovery:
    """``schedule(namespace, name)`` after every job event; the rest happens in its own tasks."""

    def __init__(
        self,
        kube: kubernetes.client.ApiClient,
        config: OperatorConfig,
        tokens: SecretTokens,
        new_attempt: Any = None,
        diagnosing: Any = None,
    ) -> None:
        self.kube = kube
        self.config = config
        self.tokens = tokens  # the jobs' sidecar tokens (shared with the collector)
        self.new_attempt = new_attempt  # callable(namespace, name, ended pod names): the monitor's reset
        self.diagnosing = diagnosing  # callable(namespace, name) -> bool: a diagnosis still cordoning
        self._running: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._again: set[tuple[str, str]] = set()
        self._timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        # One archive at a time: each may take its whole byte budget on disk, and a diagnosis worker's
        # memory to render it (as much as one diagnosis: operator.diagnosis.memoryMiB / concurrency).
        self._archiving = asyncio.Lock()
        self.evidence_limits = evidence.EvidenceLimits(
            config.archive_budget_bytes, config.diagnosis.worker_memory_bytes, config.diagnosis.timeout_seconds
        )

    def schedule(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        task = self._running.get(key)
        if task is not None and not task.done():
            self._again.add(key)  # look once more when this round is over: the event may be newer
            return
        self._running[key] = asyncio.create_task(self._round(namespace, name), name=f"recovery {namespace}/{name}")

    def forget(self, namespace: str, name: str) -> None:
        timer = self._timers.pop((namespace, name), None)
        if timer:
            timer.cancel()

    async def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        for task in self._running.values():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _wake_at(self, namespace: str, name: str, moment: datetime.datetime) -> None:
        delay = max(0.0, (moment - datetime.datetime.now(datetime.UTC)).total_seconds())
        loop = asyncio.get_running_loop()
        self.forget(namespace, name)
        self._timers[(namespace, name)] = loop.call_later(delay, self.schedule, namespace, name)

    async def _round(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        while True:
            self._again.discard(key)
            try:
                await self.reconcile(namespace, name)
            except asyncio.CancelledError:
                raise
            except Exception:  # never lose the loop; look again a little later
                log.exception("recovery of TrainingJob %s/%s failed; retrying in %.0f s", namespace, name, RETRY_S)
                self._wake_at(
                    namespace, name, datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=RETRY_S)
                )
            if key not in self._again:
                return

    # -- one look at a job ---------------------------------------------------------------------------------
    async def reconcile(self, namespace: str, name: str) -> None:
        job = await asyncio.to_thread(_read_job, self.kube, namespace, name)
        if job is None:
            self.forget(namespace, name)
            return
        try:
            spec = TrainingJobSpec.from_manifest(dict(job.get("spec") or {}))
        except InvalidSpec:
            return
        status = job.get("status") or {}
        if not status.get("conditions"):
            return  # not created yet
        await self._finish_restart(job, spec, status)
        slowdown = (
            await asyncio.to_thread(_slowdown, self.kube, namespace, status)
            if spec.recovery.restartOn.slowdownAbove
            else None
        )
        attempt = children.current_attempt(status)
        # An attempt recovery ended (maxRestarts) was archived then; one that ended by itself is archived once.
        archived_final = any(entry.get("attempt") == attempt for entry in status.get("attempts") or []) or any(
            entry.get("attempt") == attempt and entry.get("reason") == status.get("phase")
            for entry in status.get("archives") or []
        )
        verdict = decide(spec, status, datetime.datetime.now(datetime.UTC), slowdown, archived_final)
        if verdict.action is Action.NOTHING:
            return
        if verdict.action is Action.WAIT:
            log.info("TrainingJob %s/%s: %s", namespace, name, verdict.message)
            if verdict.not_before:
                self._wake_at(namespace, name, verdict.not_before)
            return
        if verdict.action is Action.ARCHIVE_FINAL:
            await self._keep(job, spec, verdict.reason)
            return
        if self.diagnosing is not None and self.diagnosing(namespace, name):
            # The finding is written but its cordon may not be: decide where to restart after it.
            self._wake_at(namespace, name, datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=1))
            return
        if verdict.action is Action.RECORD:
            await self._record(job, spec, verdict)
        elif verdict.action is Action.RESTART:
            await self._restart(job, spec, verdict)
        elif verdict.action is Action.FAIL:
            await self._fail(job, spec, verdict)

    async def _finish_restart(self, job: dict[str, Any], spec: TrainingJobSpec, status: dict[str, Any]) -> None:
        """A restart's status is written: once its backoff is over, make sure the next attempt's workers
        exist (the pod-driven status does it too, but no pod event may come after the backoff)."""
        if status.get("phase") != job_status.PENDING or not status.get("restartAfter"):
            return
        namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
        if children.backing_off(status):
            self._wake_at(namespace, name, parse_time(status["restartAfter"]))
            return
        attempt = children.current_attempt(status)
        uid = job["metadata"]["uid"]
        existing = await asyncio.to_thread(attempts.attempt_pods, self.kube, namespace, name, uid)
        ended = [pod for pod in existing if int(pod["metadata"]["labels"].get(api.ATTEMPT_LABEL, "0")) < attempt]
        await asyncio.to_thread(attempts.end_pods, self.kube, namespace, ended)  # a crash between status and delete
        names = {pod["metadata"]["name"] for pod in existing}
        if len(existing) - len(ended) >= spec.replicas:
            return  # every worker of this attempt exists (waiting to be scheduled, perhaps)
        created = await asyncio.to_thread(children.ensure_children, self.kube, job, spec, self.config.pods, names)
        if created:
            log.info("TrainingJob %s/%s: attempt %d: created %s", namespace, name, attempt, ", ".join(created))

    # -- the evidence -------------------------------------------------------------------------------------
    async def _keep(self, job: dict[str, Any], spec: TrainingJobSpec, reason: str) -> Kept:
        """Archive the current attempt's evidence, when the spec names an archive; never raises."""
        target = spec.tracing.archive
        if target is None or target.s3 is None:
            return Kept("", ())
        metadata, status = job["metadata"], job.get("status") or {}
        namespace, name = metadata["namespace"], metadata["name"]
        attempt = children.current_attempt(status)
        moment = rfc3339_now()
        started = time.monotonic()
        try:
            archive.check_target(target.s3)  # before anything is collected for it
            pods = [
                SidecarPod.from_pod(pod, self.config.pods.sidecar_metrics_port, self.config.pods.sidecar_endpoint_hosts)
                for pod in await asyncio.to_thread(
                    attempts.attempt_pods, self.kube, namespace, name, metadata["uid"], attempt
                )
                if not pod["metadata"].get("deletionTimestamp")
            ]
            token = await self.tokens(namespace, name)
            diagnosis = DiagnosisStatus.from_status(status)
            report = await asyncio.to_thread(_report, self.kube, namespace, diagnosis.report if diagnosis else None)
            layout = _layout(spec)
            manifest = evidence.Manifest(
                namespace, name, metadata["uid"], attempt, reason, moment,
                diagnosis=diagnosis.stored() if diagnosis else {},
            )  # fmt: skip
            if layout is not None:
                manifest.layout = {"tensor": layout.tp, "pipeline": layout.pp, "world_size": layout.world_size}
            refused = archive_endpoints.refusal(target.s3.endpoint, self.config.archive_endpoints)
            if refused:
                raise archive.ArchiveFailed(refused)
            # Credentials before the evidence: a Secret not opted in costs no download.
            credentials = await asyncio.to_thread(archive.read_credentials, self.kube, namespace, target.s3.secretRef)
            async with self._archiving:
                with tempfile.TemporaryDirectory(prefix="rankwatch-evidence-") as temporary:
                    directory = Path(temporary)
                    await evidence.collect(
                        directory, manifest, pods, token, layout, report, spec.world_size, self.evidence_limits
                    )
                    prefix = archive.key_prefix(target.s3, namespace, name, metadata["uid"], attempt, moment, reason)
                    path = await asyncio.to_thread(archive.upload, directory, target.s3, credentials, prefix)
            kept = Kept(path, tuple(manifest.problems))
        except archive.ArchiveFailed as error:
            kept = Kept("", (tenant_text.one_line(error),))
        except (OSError, ApiException, TokenUnavailable) as error:
            kept = Kept("", (tenant_text.one_line(f"evidence not kept: {error}"),))
        except Exception as error:  # a job's evidence must not stop its restart, nor loop the archiving
            log.exception("TrainingJob %s/%s: attempt %d evidence not kept", namespace, name, attempt)
            kept = Kept("", (tenant_text.one_line(f"evidence not kept: {type(error).__name__}: {error}"),))
        entry = {"attempt": attempt, "reason": reason, "time": moment, "path": kept.path}
        if kept.problems:
            entry["problems"] = list(kept.problems)[:10]
        await asyncio.to_thread(attempts.write_archived, self.kube, namespace, name, entry)
        if kept.path:
            log.info("TrainingJob %s/%s: attempt %d evidence kept at %s in %.1f s", namespace, name, attempt,
                     kept.path, time.monotonic() - started)  # fmt: skip
        else:
            log.warning("TrainingJob %s/%s: attempt %d evidence not kept: %s", namespace, name, attempt,
                        "; ".join(kept.problems))  # fmt: skip
            await asyncio.to_thread(
                events.post_job_event,
                job,
                "Warning",
                event_reasons.EVIDENCE_NOT_KEPT,
                f"attempt {attempt}: {'; '.join(kept.problems)}",
            )
        return kept

    # -- the actions --------------------------------------------------------------------------------------
    async def _record(self, job: dict[str, Any], spec: TrainingJobSpec, verdict: Verdict) -> None:
        namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
        key = key_of(DiagnosisStatus.from_status(job["status"]))
        kept = await self._keep(job, spec, verdict.reason)
        written = await asyncio.to_thread(attempts.write_handled, self.kube, namespace, name, key)
        if written is not None:
            where = f"; evidence: {kept.path}" if kept.path else ""
            await asyncio.to_thread(
                events.post_job_event, job, "Normal", event_reasons.RESTART_SKIPPED, verdict.message + where
            )

    async def _restart(self, job: dict[str, Any], spec: TrainingJobSpec, verdict: Verdict) -> None:
        namespace, name, status = job["metadata"]["namespace"], job["metadata"]["name"], job["status"]
        worker_failed = verdict.reason == WORKER_FAILED
        key = WORKER_FAILED if worker_failed else key_of(DiagnosisStatus.from_status(status))
        kept = await self._keep(job, spec, verdict.reason)
        ended = attempts.EndedAttempt.of(status, verdict.reason, rfc3339_now())
        ended = attempts.EndedAttempt(**{**ended.__dict__, "archive": kept.path, "archiveProblems": kept.problems})
        # A worker that failed is not evidence against its node (its code may be the cause): no avoiding.
        avoid = [] if worker_failed else await asyncio.to_thread(attempts.nodes_to_avoid, self.kube, ended.nodes)
        written = await asyncio.to_thread(
            attempts.write_restart,
            self.kube,
            namespace,
            name,
            key,
            ended,
            avoid,
            spec.recovery.backoffSeconds,
            verdict.reason,
        )
        if written is None:
            return  # handled elsewhere meanwhile
        uid = job["metadata"]["uid"]
        old = await asyncio.to_thread(attempts.attempt_pods, self.kube, namespace, name, uid, ended.attempt)
        if self.new_attempt is not None:
            self.new_attempt(namespace, name, {pod["metadata"]["name"] for pod in old})
        await asyncio.to_thread(attempts.end_pods, self.kube, namespace, old)
        cordoned = [] if worker_failed else sorted(set(ended.nodes) - set(avoid))
        away = []
        if cordoned:
            away.append(f"{', '.join(cordoned)} cordoned")
        if avoid:
            away.append(f"{', '.join(avoid)} avoided by node anti-affinity")
        message = (
            f"attempt {ended.attempt} ended ({verdict.reason}: {ended.summary or 'no summary'}); "
            f"attempt {ended.attempt + 1} starts in {spec.recovery.backoffSeconds} s"
            + (f" ({'; '.join(away)})" if away else "")
            + (f"; evidence: {kept.path}" if kept.path else "")
            + f"; {verdict.message}"
        )
        log.warning("TrainingJob %s/%s: %s", namespace, name, message)
        await asyncio.to_thread(events.post_job_event, written, "Warning", event_reasons.RESTARTING, message)
        self.schedule(namespace, name)  # creates the next attempt's workers when the backoff is over

    async def _fail(self, job: dict[str, Any], spec: TrainingJobSpec, verdict: Verdict) -> None:
        namespace, name, status = job["metadata"]["namespace"], job["metadata"]["name"], job["status"]
        key = key_of(DiagnosisStatus.from_status(status))
        kept = await self._keep(job, spec, verdict.reason)
        ended = attempts.EndedAttempt.of(status, verdict.reason, rfc3339_now())
        ended = attempts.EndedAttempt(**{**ended.__dict__, "archive": kept.path, "archiveProblems": kept.problems})
        written = await asyncio.to_thread(
            attempts.write_failed, self.kube, namespace, name, key, ended, verdict.message
        )
        if written is None:
            return
        uid = job["metadata"]["uid"]
        old = await asyncio.to_thread(attempts.attempt_pods, self.kube, namespace, name, uid, ended.attempt)
        await asyncio.to_thread(attempts.end_pods, self.kube, namespace, old)  # a hung attempt keeps no GPUs
        fresh = await asyncio.to_thread(_read_job, self.kube, namespace, name)
        message = (fresh or written).get("status", {}).get("message", verdict.message)
        log.warning("TrainingJob %s/%s failed: %s", namespace, name, message)
        await asyncio.to_thread(events.post_job_event, written, "Warning", event_reasons.RESTART_LIMIT_REACHED, message)
