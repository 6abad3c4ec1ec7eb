"""A TrainingJob status patch that applies only to the version of the job it was computed from.

The operator's status writers (pod-driven status, diagnosis) compute fields from what they read; the
job's resourceVersion in the patch makes the API server refuse it when someone wrote in between, and
the writer reads again and recomputes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch import tenant_text
from rankwatch.operator import api

STATUS_TEXT_LIMIT = 4096
"""A status string longer than this is cut (a job's frames, pod names, server error bodies end up there)."""


def displayable(fields: dict[str, Any]) -> dict[str, Any]:
    """The status fields as they are written: every string one bounded line (``tenant_text``). A writer
    that compares what it computes with what the status holds compares this."""
    return tenant_text.one_line_strings(fields, STATUS_TEXT_LIMIT)


class Patched(enum.Enum):
    WRITTEN = "written"
    CONFLICT = "conflict"  # the job changed since it was read: read again
    GONE = "gone"  # the job was deleted


def patch_status_of_version(
    objects: kubernetes.client.CustomObjectsApi, job: dict[str, Any], fields: dict[str, Any]
) -> Patched:
    metadata = job["metadata"]
    body = {"metadata": {"resourceVersion": metadata["resourceVersion"]}, "status": displayable(fields)}
    try:
        objects.patch_namespaced_custom_object_status(
            api.GROUP, api.VERSION, metadata["namespace"], api.PLURAL, metadata["name"], body
        )
    except ApiException as error:
        if error.status == 409:
            return Patched.CONFLICT
        if error.status == 404:
            return Patched.GONE
        raise
    return Patched.WRITTEN


def update_status(
    namespace: str,
    name: str,
    change: Callable[[dict[str, Any]], dict[str, Any] | None],
    attempts: int = 8,
    kube: kubernetes.client.ApiClient | None = None,
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Apply ``change(job) -> status fields`` conditionally on the job's resourceVersion, reading again
    and recomputing on conflict. Returns (job as read, fields written), or None when ``change`` had
    nothing to write or the job is gone. Blocking. ``kube``: the client (default: the library's
    default configuration, which ``rankwatch.kube.api_client`` sets)."""
    objects = kubernetes.client.CustomObjectsApi(kube)
    for _attempt in range(attempts):
        try:
            job = objects.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        fields = change(job)
        if not fields:
            return None
        patched = patch_status_of_version(objects, job, fields)
        if patched is Patched.CONFLICT:
            continue
        return (job, fields) if patched is Patched.WRITTEN else None
    raise RuntimeError(f"TrainingJob {namespace}/{name}: status kept changing; not written")
