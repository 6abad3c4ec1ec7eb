"""The fake GPU nodes kwok manages: what a node of a GPU pool looks like to the scheduler."""

from __future__ import annotations

from typing import Any

MANAGED_LABEL = "rankwatch.io/local-cluster"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
GPUS_PER_NODE = 8
CPUS_PER_NODE = 96


def node_name(index: int) -> str:
    return f"gpu-node-{index}"


def fake_gpu_node(index: int) -> dict[str, Any]:
    """A Node object with 8 GPUs and the labels NVIDIA's GPU feature discovery would set."""
    name = node_name(index)
    resources = {
        "cpu": str(CPUS_PER_NODE),
        "memory": "1Ti",
        "pods": "110",
        "ephemeral-storage": "4Ti",
        "nvidia.com/gpu": str(GPUS_PER_NODE),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": "gpu-8x-h100",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                "nvidia.com/gpu.count": str(GPUS_PER_NODE),
                "rankwatch.io/node-pool": "gpu",
                "type": "kwok",
                MANAGED_LABEL: "true",
            },
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "status": {
            "capacity": resources,
            "allocatable": resources,
            # Fake, never bound: documentation range, distinct per node like a real pool.
            "addresses": [
                {"type": "InternalIP", "address": f"192.0.2.{index % 250 + 1}"},
                {"type": "Hostname", "address": name},
            ],
        },
    }
