"""A job's status, kept in step with its worker pods: pod events of one job within a short delay make
one sync, which reads the job, derives the status (``job_status.derive``) and writes it only if it
changed and nobody wrote in between.

Event handlers (unlike kopf timers) need no finalizer, so a job stays deletable without the operator.
"""

from __future__ import annotations

import asyncio
import logging

import kopf
import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch import tenant_text
from rankwatch.kube import pod_names
from rankwatch.model import event_reasons
from rankwatch.operator import api
from rankwatch.operator.config import OperatorConfig, WorkerPodSettings
from rankwatch.operator.lifecycle import children, job_status
from rankwatch.operator.lifecycle.status_patch import Patched, displayable, patch_status_of_version
from rankwatch.operator.spec import InvalidSpec, TrainingJobSpec
from rankwatch.timestamps import rfc3339_now

log = logging.getLogger(__name__)

SYNC_RETRY_SECONDS = 5.0


class StatusSync:
    """Coalesces the pod and job events of each job into one ``sync_status`` after ``delay_s``."""

    def __init__(self, kube: kubernetes.client.ApiClient, config: OperatorConfig) -> None:
        self.kube = kube
        self.config = config
        self._scheduled: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    def schedule(self, namespace: str, name: str, index: kopf.Index) -> None:
        key = (namespace, name)
        task = self._scheduled.get(key)
        if task is None or task.done():
            self._scheduled[key] = asyncio.create_task(self._sync_later(namespace, name, index))

    async def _sync_later(self, namespace: str, name: str, index: kopf.Index) -> None:
        await asyncio.sleep(self.config.status_debounce_seconds)
        self._scheduled.pop((namespace, name), None)
        # One sync of a job at a time, each with the pods as they are when it starts: a sync still
        # holding an older view of the pods must not judge a job another sync has seen running.
        lock = self._locks.setdefault((namespace, name), asyncio.Lock())
        try:
            async with lock:
                pods = list(index.get((namespace, name), []))
                await asyncio.to_thread(sync_status, self.kube, namespace, name, pods, self.config.pods)
        except Exception:  # never kill the loop; try again shortly even if no new event comes
            log.exception("status sync of TrainingJob %s/%s failed; retrying", namespace, name)
            await asyncio.sleep(SYNC_RETRY_SECONDS)
            self.schedule(namespace, name, index)


def sync_status(
    kube: kubernetes.client.ApiClient,
    namespace: str,
    name: str,
    pods: list[job_status.WorkerPod],
    config: WorkerPodSettings,
) -> None:
    """Recompute one job's status; write it only if it changed and nobody wrote in between."""
    objects = kubernetes.client.CustomObjectsApi(kube)
    for _attempt in range(5):
        try:
            job = objects.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
        except ApiException as error:
            if error.status == 404:
                return
            raise
        previous = job.get("status") or {}
        if previous.get("phase") in job_status.TERMINAL or not previous.get("conditions"):
            return  # finished, or create_workers has not run yet
        try:
            job_spec = TrainingJobSpec.from_manifest(job["spec"])
        except InvalidSpec:
            return  # create_workers has reported it
        # Only the pods the job controls: anyone in the namespace can label a pod with the job's name.
        pods = [pod for pod in pods if pod.owner_uid == job["metadata"].get("uid")]
        attempt = children.current_attempt(previous)
        current = [pod for pod in pods if pod.attempt == attempt and not pod.deleting]
        if job_spec.suspend and (ending := sorted(pod.name for pod in pods if not pod.deleting)):
            deleted = children.delete_workers(kube, namespace, ending)
            if deleted:
                message = tenant_text.one_line(f"spec.suspend is true: deleted Pod/{', Pod/'.join(deleted)}")
                kopf.event(job, type="Normal", reason=event_reasons.SUSPENDING, message=message)
        restartable = (job_status.PENDING, job_status.SUSPENDED)
        if previous.get("phase") in restartable and not job_spec.suspend and len(current) < job_spec.replicas:
            # A pod deleted before the attempt started is recreated; after the start it is a failure.
            # The operator's pod index lags behind pods just made (thousands at once on a large cluster):
            # the API server's list says which are missing, so a lagging index costs one list per sync,
            # not a refused create and a read per pod (3.6 requests per pod at 8,000 pods).
            existing = pod_names(kube, namespace, f"{api.JOB_NAME_LABEL}={name}")
            wanted = {api.worker_pod_name(name, index, attempt) for index in range(job_spec.replicas)}
            created = [] if wanted <= existing else children.ensure_children(kube, job, job_spec, config, existing)
            if created:
                message = tenant_text.one_line(f"recreated {', '.join(created)}")
                kopf.event(job, type="Normal", reason=event_reasons.RECREATED, message=message)
                return  # their events bring us back
        generation = job["metadata"].get("generation", 1)
        new, events = job_status.derive(job_spec, pods, previous, rfc3339_now(), generation)
        new = displayable(new)
        changed = {key: value for key, value in new.items() if previous.get(key) != value}
        if not changed:
            return
        patched = patch_status_of_version(objects, job, changed)  # a concurrent writer means recompute
        if patched is Patched.CONFLICT:
            continue
        if patched is Patched.GONE:
            return
        for event in events:
            kopf.event(job, type=event.type, reason=event.reason, message=tenant_text.one_line(event.message))
        return
