"""Create a job's Secret, Service and worker Pods idempotently.

Names are deterministic, so a retried handler or a restarted operator finds what an earlier run
created (HTTP 409) instead of making duplicates; an existing object that some other owner holds
is refused, never adopted or overwritten.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rankwatch.kube import drain
from rankwatch.operator import api
from rankwatch.operator.config import WorkerPodSettings
from rankwatch.operator.lifecycle import pod_spec
from rankwatch.operator.spec import InvalidSpec, TrainingJobSpec

POD_CREATES_IN_FLIGHT = 8
"""Worker pods of one job created at once. One after another, a job's pods waited on each other's
round trip (~24 pods/s at 1,000 nodes, 332 s to make 8,000 pods); the API server bounds what more
helps, and a job's creates must not crowd out everyone else's requests."""


class NameConflict(Exception):
    """A child's name is taken by an object this job does not own."""


def _create(
    kind: str,
    create: Callable[..., Any],
    read: Callable[[str, str], Any],
    manifest: dict[str, Any],
    job_uid: str,
) -> bool:
    """Create ``manifest``; True if created, False if ours already exists."""
    namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    try:
        # The echo of the object is not read into models: thousands of pods' worth is garbage the
        # operator's heap keeps the size of (see rankwatch.kube.pod_names).
        drain(create(namespace, manifest, _preload_content=False))
        return True
    except ApiException as error:
        if error.status == 409:
            existing = read(name, namespace)
            owners = existing.metadata.owner_references or []
            if any(owner.uid == job_uid for owner in owners):
                return False
            raise NameConflict(
                f"{kind} {namespace}/{name} already exists and does not belong to this TrainingJob; delete or rename it"
            ) from error
        if error.status in (400, 422):  # the API server refuses what the template produced
            raise InvalidSpec(f"the API server refused {kind} {namespace}/{name}: {_reason(error)}") from error
        # 403 (RBAC, terminating namespace), 5xx, timeouts: not the job's fault; kopf retries.
        raise kopf.TemporaryError(f"creating {kind} {namespace}/{name} failed: {_reason(error)}", delay=5) from error


def _reason(error: ApiException) -> str:
    try:
        return json.loads(error.body)["message"]
    except (TypeError, ValueError, KeyError):
        return f"HTTP {error.status} {error.reason}: {(error.body or '')[:500]}"


def current_attempt(status: dict[str, Any]) -> int:
    """The attempt whose workers should exist: 0, then one more after each restart."""
    return int(status.get("restarts") or 0)


def backing_off(status: dict[str, Any], now: datetime.datetime | None = None) -> bool:
    """True while a restart waits out its backoff (``status.restartAfter`` in the future)."""
    after = status.get("restartAfter")
    if not after:
        return False
    moment = now or datetime.datetime.now(datetime.UTC)
    return datetime.datetime.fromisoformat(after.replace("Z", "+00:00")) > moment


def ensure_children(
    kube: client.ApiClient,
    job: dict[str, Any],
    spec: TrainingJobSpec,
    config: WorkerPodSettings,
    existing_pods: set[str],
) -> list[str]:
    """Make sure the Secret, the Service and every worker Pod of the current attempt exist (no pods
    while a restart backs off or the job is suspended); return what was created."""
    core = client.CoreV1Api(kube)
    uid = job["metadata"]["uid"]
    status = job.get("status") or {}
    attempt, avoid = current_attempt(status), list(status.get("avoidNodes") or [])
    # Build every pod first: a template problem fails the whole job before anything is created.
    pods = [pod_spec.worker_pod(job, spec, index, config, attempt, avoid) for index in range(spec.replicas)]
    if backing_off(status) or spec.suspend:
        pods = []
    created: list[str] = []
    if spec.tracing.enabled and _create(
        "Secret", core.create_namespaced_secret, core.read_namespaced_secret, pod_spec.token_secret(job), uid
    ):
        created.append(f"Secret/{api.token_secret_name(job['metadata']['name'])}")
    if _create(
        "Service",
        core.create_namespaced_service,
        core.read_namespaced_service,
        pod_spec.headless_service(job, spec),
        uid,
    ):
        created.append(f"Service/{api.service_name(job['metadata']['name'])}")
    missing = [pod for pod in pods if pod["metadata"]["name"] not in existing_pods]
    if not missing:
        return created

    def create_pod(pod: dict[str, Any]) -> bool:
        return _create("Pod", core.create_namespaced_pod, core.read_namespaced_pod, pod, uid)

    # The first failure (in the pods' order) is raised once every create in flight has ended; what was
    # made before it stays (names are deterministic: the retry finds them).
    with ThreadPoolExecutor(min(POD_CREATES_IN_FLIGHT, len(missing)), thread_name_prefix="create-pods") as pool:
        made = list(pool.map(create_pod, missing))
    created += [f"Pod/{pod['metadata']['name']}" for pod, new in zip(missing, made, strict=True) if new]
    return created


def delete_workers(kube: client.ApiClient, namespace: str, names: list[str]) -> list[str]:
    """Delete the named worker pods (a suspended job holds none); returns those asked to go. A pod
    already gone is fine; the next sync sees any that a failed call left."""
    core = client.CoreV1Api(kube)
    deleted = []
    for name in names:
        try:
            drain(core.delete_namespaced_pod(name, namespace, _preload_content=False))
            deleted.append(name)
        except ApiException as error:
            if error.status != 404:
                raise kopf.TemporaryError(
                    f"deleting Pod {namespace}/{name} failed: {_reason(error)}", delay=5
                ) from error
    return deleted
