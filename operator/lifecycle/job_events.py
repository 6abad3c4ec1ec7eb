"""Events about a TrainingJob posted straight through the API (blocking: call from a worker thread).

kopf's ``kopf.event`` only works inside a kopf handler's context; the monitor runs in a task of its
own, so it posts here, in the same shape (``From: rankwatch-operator`` in ``kubectl describe``).
"""

from __future__ import annotations

import datetime
import logging
import socket
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

COMPONENT = "rankwatch-operator"
MAX_MESSAGE = 1024

log = logging.getLogger(__name__)


def post(job: dict[str, Any], type_: str, reason: str, message: str) -> None:
    """A Normal or Warning Event on ``job``; failures are logged, never raised (Events are auxiliary)."""
    metadata = job["metadata"]
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 5] + " ..."
    now = datetime.datetime.now(datetime.UTC).isoformat()
    body = {
        "metadata": {"namespace": metadata["namespace"], "generateName": f"{metadata['name']}."},
        "action": reason,
        "type": type_,
        "reason": reason,
        "message": message,
        "reportingComponent": COMPONENT,
        "reportingInstance": socket.gethostname(),
        "source": {"component": COMPONENT},
        "involvedObject": {
            "apiVersion": job.get("apiVersion", "rankwatch.io/v1alpha1"),
            "kind": job.get("kind", "TrainingJob"),
            "name": metadata["name"],
            "namespace": metadata["namespace"],
            "uid": metadata["uid"],
            "resourceVersion": metadata.get("resourceVersion"),
        },
        "firstTimestamp": now,
        "lastTimestamp": now,
        "eventTime": now,
        "count": 1,
    }
    try:
        kubernetes.client.CoreV1Api().create_namespaced_event(metadata["namespace"], body)
    except ApiException as error:
        log.warning("Event %s on TrainingJob %s/%s not posted: HTTP %s", reason, metadata["namespace"],
                    metadata["name"], error.status)  # fmt: skip
