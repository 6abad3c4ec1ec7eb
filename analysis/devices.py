"""The GPU behind each rank a finding names, where the traces record it (a version 2 ring header: the
CUDA device ordinal and UUID the interposer read from the driver), so a report names rank, node and GPU:
the UUID is what nvidia-smi, DCGM and the device plugin call the board that has to be looked at."""

from __future__ import annotations

from rankwatch.analysis.findings import Finding
from rankwatch.analysis.trace import Trace

MAX_GPUS = 32
"""GPUs listed per finding (its first named ranks'): a finding that lists every member of a stuck
collective must not carry thousands."""


def add_gpus(trace: Trace, findings: list[Finding]) -> None:
    """Adds ``gpus`` ([{rank, node, index, uuid}]) to the findings' evidence for the named ranks whose
    trace says which GPU they ran on."""
    for finding in findings:
        gpus = [
            {"rank": rank, "node": trace.node_of(rank), "index": source.gpu_index, "uuid": source.gpu_uuid}
            for rank in finding.ranks[:MAX_GPUS]
            if (source := trace.ranks.get(rank)) is not None and source.gpu_index is not None
        ]
        if gpus:
            finding.evidence["gpus"] = gpus


def gpu_text(gpu: dict) -> str:
    """``rank 3 on node gpu-node-1: GPU 3 (GPU-5f1c…)``."""
    uuid = f" ({gpu['uuid']})" if gpu.get("uuid") else ""
    return f"rank {gpu['rank']} on node {gpu['node']}: GPU {gpu['index']}{uuid}"
