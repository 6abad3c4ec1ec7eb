"""The API calls of remediation: read nodes and a job's pods, write conditional node patches.

Blocking (the kubernetes client is synchronous): call from a thread when on the event loop.
Every call takes the ``ApiClient`` to use, so the same code runs with the operator's identity,
a person's kubeconfig (the CLI) or a ServiceAccount token (the RBAC test).
"""

from __future__ import annotations

from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rankwatch.kube import with_retries
from rankwatch.operator import api as names
from rankwatch.operator.events import MERGE_PATCH
from rankwatch.operator.remediation.node_marks import NodeView


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
    """Apply a merge patch carrying a resourceVersion; False if the node changed meanwhile (409) or is gone.

    A transient failure (5xx, timeout, dropped connection) is tried again a few times (see
    :func:`rankwatch.kube.with_retries`), then raised. Repeating is safe: if a try landed and only
    its answer was lost, the next one carries a stale resourceVersion and gets 409 (False here), so
    the caller reads the node again and finds its own mark.
    """
    try:
        with_retries(
            lambda: client.CoreV1Api(api).patch_node(name, patch, _content_type=MERGE_PATCH),
            api,
            what=f"PATCH node {name}",
        )
    except ApiException as error:
        if error.status in (404, 409):
            return False
        raise
    return True
