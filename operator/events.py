"""Events about rankwatch's objects (TrainingJobs, Nodes), named after what they report.

One poster for the operator (diagnosis, remediation): an Event's name is derived from (target, key),
so the same happening is one Event however often it is posted: by a retry, a restarted operator or
a new leader finishing what the old one began. Blocking (the Kubernetes client): call from a thread.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rankwatch import tenant_text
from rankwatch.operator import api as names
from rankwatch.timestamps import rfc3339

REPORTING_COMPONENT = "rankwatch-operator"
MERGE_PATCH = "application/merge-patch+json"
EVENT_MESSAGE_MAX_CHARS = 1024

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EventTarget:
    """The object an Event is about (``involvedObject``); ``namespace`` empty for a Node."""

    api_version: str
    kind: str
    name: str
    uid: str
    namespace: str = ""

    @classmethod
    def node(cls, name: str, uid: str) -> EventTarget:
        return cls("v1", "Node", name, uid)

    @classmethod
    def job(cls, namespace: str, name: str, uid: str) -> EventTarget:
        return cls(names.API_VERSION, names.KIND, name, uid, namespace)


def _instance() -> str:
    return os.environ.get("POD_NAME") or socket.gethostname()


def post_job_event(
    job: dict[str, Any], type_: str, reason: str, message: str, kube: client.ApiClient | None = None
) -> None:
    """A new Event on TrainingJob ``job`` each call (a restart, a skipped restart: each is news);
    failures are logged, never raised (Events are auxiliary)."""
    metadata = job["metadata"]
    target = EventTarget.job(metadata["namespace"], metadata["name"], metadata["uid"])
    key = f"{reason}/{uuid.uuid4().hex}"
    try:
        post_event(kube, target, type=type_, reason=reason, message=message, key=key, repeat=False,
                   now=datetime.datetime.now(datetime.UTC))  # fmt: skip
    except ApiException as error:
        log.warning("Event %s on TrainingJob %s/%s not posted: HTTP %s", reason, metadata["namespace"],
                    metadata["name"], error.status)  # fmt: skip


def post_event(
    api: client.ApiClient | None,
    target: EventTarget,
    *,
    type: str,
    reason: str,
    message: str,
    key: str,
    repeat: bool,
    now: datetime.datetime,
) -> bool:
    """Post an Event named after ``key``, so the same happening is never two Events; True if it is new.

    The name is derived from (target, key): a second post of the same key (a retry, a restarted
    operator, the other replica) finds it (409) and, if ``repeat``, counts it again on the same
    Event as the API server's own series do; otherwise leaves it be. Cluster-scoped objects'
    Events live in ``default``, where ``kubectl describe node`` finds them.
    """
    namespace = target.namespace or "default"
    digest = hashlib.sha256(f"{target.kind}/{target.uid}/{key}".encode()).hexdigest()[:16]
    event_name = f"{target.name}.rankwatch-{digest}"
    stamp = rfc3339(now)
    message = tenant_text.one_line(message, EVENT_MESSAGE_MAX_CHARS)  # a job's text: no line of its own
    body = {
        "metadata": {"name": event_name, "namespace": namespace},
        "involvedObject": {
            "apiVersion": target.api_version,
            "kind": target.kind,
            "name": target.name,
            "uid": target.uid,
            **({"namespace": target.namespace} if target.namespace else {}),
        },
        "type": type,
        "reason": reason,
        "message": message,
        "count": 1,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "source": {"component": REPORTING_COMPONENT},
        "reportingComponent": REPORTING_COMPONENT,
        "reportingInstance": _instance(),
    }
    events = client.CoreV1Api(api)
    try:
        events.create_namespaced_event(namespace, body)
        return True
    except ApiException as error:
        if error.status != 409:
            raise
    if not repeat:
        return False
    existing = events.read_namespaced_event(event_name, namespace)
    events.patch_namespaced_event(
        event_name,
        namespace,
        {"count": (existing.count or 1) + 1, "lastTimestamp": stamp, "message": message},
        _content_type=MERGE_PATCH,
    )
    return False
