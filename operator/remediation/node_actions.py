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
from rankwatch.operator import ownership
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
    """Nodes that pods the job controls are bound to (``spec.nodeName``).

    Only pods whose controller reference is the TrainingJob with ``uid`` count: a pod that merely
    carries the job's label (a bare pod anyone in the namespace can create, bound by ``nodeName``
    to any node) does not make its node one of the job's.
    """
    pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=f"{names.JOB_NAME_LABEL}={name}")
    return frozenset(
        pod.spec.node_name for pod in pods.items if pod.spec.node_name and ownership.is_owned_by(pod.metadata, uid)
    )


def shared_with_others(api: client.ApiClient, node: str, namespace: str) -> bool:
    """Whether pods of namespaces other than ``namespace`` run on ``node`` (DaemonSet pods and ended
    pods aside: every node has them); True also when rankwatch may not list pods cluster-wide (its
    RBAC is namespaced when ``operator.namespaces`` is listed): it cannot tell, so it assumes so."""
    try:
        pods = client.CoreV1Api(api).list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}")
    except ApiException as error:
        if error.status in (401, 403):
            return True
        raise
    for pod in pods.items:
        if pod.metadata.namespace == namespace or (pod.status and pod.status.phase in ("Succeeded", "Failed")):
            continue
        if any(o.kind == "DaemonSet" and o.controller for o in pod.metadata.owner_references or []):
            continue
        return True
    return False


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
