"""Which pods are a TrainingJob's: those its controller reference names, never those its labels match.

Labels are written by whoever creates a pod: any pod in the namespace (a bare pod, another job's
template) can carry ``rankwatch.io/job-name=<job>``. An ownerReference with ``controller: true`` and
the job's uid is written by rankwatch when it creates the worker pods; anyone who can create pods
in the namespace could forge it too, but only for jobs of their own namespace (the uid must match,
and ownerReferences never cross namespaces), so what it can reach stays inside that namespace.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rankwatch.operator import api


def controller_uid(metadata: Any) -> str:
    """The uid of the TrainingJob that controls the object ("" if none does).

    ``metadata`` is a pod's metadata as the kubernetes client's model or as the API's JSON (kopf).
    """
    references = _get(metadata, "ownerReferences", "owner_references") or []
    for reference in references:
        if _get(reference, "kind", "kind") == api.KIND and _get(reference, "controller", "controller"):
            api_version = _get(reference, "apiVersion", "api_version") or ""
            if api_version.partition("/")[0] == api.GROUP:
                return _get(reference, "uid", "uid") or ""
    return ""


def is_owned_by(metadata: Any, job_uid: str) -> bool:
    """The object's controller is the TrainingJob with ``job_uid`` (an empty uid owns nothing)."""
    return bool(job_uid) and controller_uid(metadata) == job_uid


def _get(item: Any, json_name: str, model_name: str) -> Any:
    if isinstance(item, Mapping):
        return item.get(json_name)
    return getattr(item, model_name, None)
