"""Cordon tests' world: the four GPU nodes, a TrainingJob nobody runs with one pod bound to each named
node, the CordonRequest and policy the remediation takes, a bare pod any tenant may create."""

from __future__ import annotations

import dataclasses

import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch.model.finding import Finding
from rankwatch.operator.config import BreakerSettings
from rankwatch.operator.remediation import node_marks
from rankwatch.operator.remediation.cordon import (
    CordonRequest,
    RemediationPolicy,
    Safeguards,
)
from rankwatch.operator.spec import Remediation

GPU_NODES = [f"gpu-node-{i}" for i in range(4)]


NO_BREAKER = Safeguards(breaker=BreakerSettings(max_share=1.0))


def reset_node(core: kubernetes.client.CoreV1Api, name: str) -> None:
    """Remove everything rankwatch (or a test) put on the node."""
    try:
        node = core.read_node(name)
    except ApiException as error:
        if error.status == 404:
            return
        raise
    keys = [*node_marks.MARK_ANNOTATIONS, node_marks.UNCORDONED_AT, node_marks.UNCORDON_REQUEST]
    taints = [
        core.api_client.sanitize_for_serialization(t) for t in node.spec.taints or [] if t.key != node_marks.TAINT_KEY
    ]
    patch = {
        "metadata": {"annotations": dict.fromkeys(keys), "labels": {node_marks.OPT_OUT_LABEL: None}},
        "spec": {"unschedulable": None, "taints": taints or None},
    }
    core.patch_node(name, patch, _content_type="application/merge-patch+json")


def job_on_nodes(api, namespace: str, name: str, nodes: list[str], **remediation) -> CordonRequest:
    """A TrainingJob (nobody runs it) with one worker pod bound to each node; the CordonRequest's job part."""
    job = kubernetes.client.CustomObjectsApi(api).create_namespaced_custom_object(
        "rankwatch.io",
        "v1alpha1",
        namespace,
        "trainingjobs",
        {
            "apiVersion": "rankwatch.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": name},
            "spec": {
                "replicas": max(1, len(nodes)),
                "nprocPerNode": 1,
                "remediation": remediation,
                "template": {"spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]}},
            },
        },
    )
    uid = job["metadata"]["uid"]
    owner = {"apiVersion": "rankwatch.io/v1alpha1", "kind": "TrainingJob", "name": name, "uid": uid, "controller": True}
    for index, node in enumerate(nodes):
        kubernetes.client.CoreV1Api(api).create_namespaced_pod(
            namespace,
            {
                "metadata": {
                    "name": f"{name}-worker-{index}",
                    "labels": {"rankwatch.io/job-name": name, "rankwatch.io/replica-index": str(index)},
                    "ownerReferences": [owner],
                },
                "spec": {"nodeName": node, "containers": [{"name": "trainer", "image": "trainer:1"}]},
            },
        )
    return CordonRequest(namespace, name, uid, Finding("straggler", [13], [], None, 0.9, "rank 13 is 24% slower"))


def suspect(base: CordonRequest, *nodes: str) -> CordonRequest:
    """``base``'s job, its finding blaming ``nodes`` (in that order)."""
    evidence = {"wait_ms": 0.4, "median_wait_ms": 9.8}
    return dataclasses.replace(base, finding=dataclasses.replace(base.finding, nodes=list(nodes), evidence=evidence))


def policy(safeguards: Safeguards = NO_BREAKER, **job) -> RemediationPolicy:
    return RemediationPolicy(Remediation(**job), safeguards)


def bare_pod(api, namespace: str, name: str, node: str, labels: dict[str, str]) -> None:
    """A pod nobody's controller owns, bound by ``nodeName`` to ``node``: what any tenant may create."""
    kubernetes.client.CoreV1Api(api).create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": name, "labels": labels},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox:1"}]},
        },
    )
