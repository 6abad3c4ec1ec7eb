"""The API calls of remediation: read nodes and a job's pods, write conditional node patches, post Events.

Blocking (the kubernetes client is synchronous): call from a thread when on the event loop.
Every call takes the ``ApiClient`` to use, so the same code runs with the operator's identity,
a person's kubeconfig (the CLI) or a ServiceAccount token (the RBAC test).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import socket
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rankwatch.operator import api as names
from rankwatch.operator.remediation.node_marks import NodeView, format_time

REPORTING_COMPONENT = "rankwatch-operator"
MERGE_PATCH = "application/merge-patch+json"
EVENT_MESSAGE_MAX_CHARS = 1024


def list_nodes(api: client.ApiClient) -> dict[str, NodeView]:
    """Every node of the cluster (the breaker needs the total and all of rankwatch's marks)."""
    nodes = client.CoreV1Api(api).list_node()
    return {view.name: view for view in (NodeView.from_node(api.sanitize_for_serialization(n)) for n in nodes.items)}


def read_node(api: client.ApiClient, name: str) -> NodeView | None:
    try:
        node = client.CoreV1Api(api).read_node(name)
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    return NodeView.from_node(api.sanitize_for_serialization(node))


def nodes_of_job(api: client.ApiClient, namespace: str, name: str, uid: str) -> frozenset[str]:
    """Nodes that pods of the job are bound to (label ``rankwatch.io/job-name``, ``spec.nodeName``).

    A pod whose controlling owner is a TrainingJob with another uid belongs to an earlier job of
    the same name and does not count.
    """
    pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=f"{names.JOB_NAME_LABEL}={name}")
    found = set()
    for pod in pods.items:
        owners = [o for o in pod.metadata.owner_references or [] if o.kind == names.KIND and o.controller]
        if uid and owners and owners[0].uid != uid:
            continue
        if pod.spec.node_name:
            found.add(pod.spec.node_name)
    return frozenset(found)


def patch_node(api: client.ApiClient, name: str, patch: dict[str, Any]) -> bool:
    """Apply a merge patch carrying a resourceVersion; False if the node changed meanwhile (409) or is gone."""
    try:
        client.CoreV1Api(api).patch_node(name, patch, _content_type=MERGE_PATCH)
    except ApiException as error:
        if error.status in (404, 409):
            return False
        raise
    return True


@dataclass(frozen=True)
class EventTarget:
    """The object an Event is about (``involvedObject``); ``namespace`` empty for a Node."""

    api_version: str
    kind: str
    name: str
    uid: str
    namespace: str = ""

    @classmethod
    def node(cls, view: NodeView) -> EventTarget:
        return cls("v1", "Node", view.name, view.uid)

    @classmethod
    def job(cls, namespace: str, name: str, uid: str) -> EventTarget:
        return cls(names.API_VERSION, names.KIND, name, uid, namespace)


def _instance() -> str:
    return os.environ.get("POD_NAME") or socket.gethostname()


def post_event(
    api: client.ApiClient,
    target: EventTarget,
    *,
    type: str,
    reason: str,
    message: str,
    key: str,
    repeat: bool,
    now: datetime.datetime,
) -> None:
    """Post an Event named after ``key``, so the same happening is never two Events.

    The name is derived from (target, key): a second post of the same key (a retry, a restarted
    operator, the other replica) finds it (409) and, if ``repeat``, counts it again on the same
    Event as the API server's own series do; otherwise leaves it be. Cluster-scoped objects'
    Events live in ``default``, where ``kubectl describe node`` finds them.
    """
    namespace = target.namespace or "default"
    digest = hashlib.sha256(f"{target.kind}/{target.uid}/{key}".encode()).hexdigest()[:16]
    event_name = f"{target.name}.rankwatch-{digest}"
    stamp = format_time(now).split(".")[0] + "Z"
    if len(message) > EVENT_MESSAGE_MAX_CHARS:
        message = message[: EVENT_MESSAGE_MAX_CHARS - 1] + "…"
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
        return
    except ApiException as error:
        if error.status != 409:
            raise
    if not repeat:
        return
    existing = events.read_namespaced_event(event_name, namespace)
    events.patch_namespaced_event(
        event_name,
        namespace,
        {"count": (existing.count or 1) + 1, "lastTimestamp": stamp, "message": message},
        _content_type=MERGE_PATCH,
    )
