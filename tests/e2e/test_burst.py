"""A burst: twenty jobs hang at once (a switch failure). The operator, a real process, runs at most its
configured number of diagnoses together, each analysis in a worker within its share of the memory
budget; its memory and its workers' stay under the limit the chart gives the container; every job
is diagnosed, none lost in the queue."""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path

import kubernetes
import pytest
from trainingjobs import standin_job, stored_diagnosis

pytestmark = pytest.mark.e2e

JOBS = 20
CONCURRENCY = 2
MEMORY_MIB = 512
CONTAINER_LIMIT = 1 << 30  # the chart's operator.resources.limits.memory
WORKER = "rankwatch.operator.diagnosis.diagnose.worker"


HANG = {"RANKWATCH_STANDIN_FAULT_RANK": "1", "RANKWATCH_STANDIN_HANG_BEFORE_CALL": "2000"}
"""Rank 1 of each job stops before its 2,000th NCCL call."""


def hang_job(name: str) -> dict:
    """One pod of two ranks (TP 2), asking for no GPU: 20 of them fit the four nodes at once."""
    return standin_job(name, HANG, replicas=1, tensor=2, gpus=False)


class Sampler(threading.Thread):
    """Every 50 ms: the resident memory of the operator and all its descendants, and how many of them
    are analysis workers."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak_bytes, self.peak_workers = pid, 0, 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.05):
            tree = self._tree()
            self.peak_bytes = max(self.peak_bytes, sum(_rss(pid) for pid in tree))
            workers = sum(WORKER in _cmdline(pid) for pid in tree)
            self.peak_workers = max(self.peak_workers, workers)

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(parent, []).append(int(entry.name))
        tree, pending = [], [self.pid]
        while pending:
            pid = pending.pop()
            tree.append(pid)
            pending += children.get(pid, [])
        return tree


def _rss(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    line = next((line for line in status.splitlines() if line.startswith("VmRSS:")), "VmRSS: 0 kB")
    return int(line.split()[1]) * 1024


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.timeout(900)
def test_twenty_jobs_hanging_at_once_are_all_diagnosed_within_the_limits(
    api, kubeconfig, unwatched_namespace, processes, eventually, tmp_path
):
    namespace = unwatched_namespace
    port = processes.free_port()
    limits = {"RANKWATCH_DIAGNOSIS_CONCURRENCY": str(CONCURRENCY), "RANKWATCH_DIAGNOSIS_MEMORY_MIB": str(MEMORY_MIB)}
    operator = processes.operator(kubeconfig, namespace, tmp_path / "operator.log", port, limits)
    sampler = Sampler(operator.pid)
    sampler.start()
    runner = processes.pod_runner(kubeconfig, f"http://127.0.0.1:{port}", namespace, tmp_path / "pods")
    objects = kubernetes.client.CustomObjectsApi(api)
    names = [f"burst-{index:02d}" for index in range(JOBS)]
    try:
        for name in names:
            objects.create_namespaced_custom_object("rankwatch.io", "v1alpha1", namespace, "trainingjobs",
                                                    hang_job(name))  # fmt: skip
        started = time.monotonic()

        def hung() -> list[str]:
            items = objects.list_namespaced_custom_object("rankwatch.io", "v1alpha1", namespace, "trainingjobs")
            return sorted(
                job["metadata"]["name"]
                for job in items["items"]
                if stored_diagnosis(job).get("kind") in ("Hang", "StuckInCollective")
            )

        def all_hung() -> list[str] | None:
            found = hung()
            return found if len(found) == JOBS else None

        done = eventually(all_hung, 600, interval=2, what=f"all {JOBS} jobs Hung")
        elapsed = time.monotonic() - started
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            metrics = response.read().decode()
    finally:
        sampler.stopped.set()
        processes.stop(runner)
        processes.stop(operator)
    assert done == names
    failures = [line for line in metrics.splitlines() if line.startswith("rankwatch_diagnoses_total{")]
    worker_peak = [
        line for line in metrics.splitlines() if line.startswith("rankwatch_diagnosis_worker_peak_bytes_sum")
    ]
    print(
        f"burst of {JOBS} hung jobs: all diagnosed in {elapsed:.0f} s after creation; at most {sampler.peak_workers} "
        f"analysis workers at once (limit {CONCURRENCY}); peak memory of the operator and its workers "
        f"{sampler.peak_bytes / 2**20:.0f} MiB (container limit {CONTAINER_LIMIT >> 20} MiB); {failures}; {worker_peak}"
    )
    assert 1 <= sampler.peak_workers <= CONCURRENCY
    assert sampler.peak_bytes < CONTAINER_LIMIT
    assert not [line for line in failures if "out_of_memory" in line or "timeout" in line]
