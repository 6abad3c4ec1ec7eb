"""Cost of a Prometheus scrape of the operator's /metrics, and its series count, with the per-job series.

The operator's state is built as the collector builds it (``JobState.add_summary`` with window
summaries of 8 ranks per pod, 4 communicators per rank: TP 8, DP, PP, world), each job's status as
a watch event carries it (Running, healthy, conditions); then the registry the operator serves
(``prometheus_client``'s default one: process metrics, the diagnosis, remediation and alerting
counters, and ``JobMetrics``) is rendered as /metrics renders it, on the event loop. Baseline: the
same registry without ``JobMetrics`` (the operator's /metrics before the per-job series). Each render
is timed twice: as is (a render's allocations can start a full collection of the state's millions of
objects, as any allocation on the operator's loop can) and with that state moved out of the
collector's reach (``gc.freeze()``): the render's own work.

    python bench/operator_metrics.py [--scrapes 20]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from prometheus_client import REGISTRY, generate_latest

from rankwatch.operator.diagnosis import metrics as _diagnosis_metrics  # noqa: F401  (the operator's counters)
from rankwatch.operator.diagnosis.job_metrics import JobMetrics, JobMetricsSettings
from rankwatch.operator.diagnosis.job_state import JobStore
from rankwatch.operator.remediation.metrics import RemediationMetrics
from rankwatch.protocol import CommWindow, Quantiles, RankWindow, WindowSummary

RANKS_PER_POD = 8
TP, PP = 8, 4
SCRAPE_INTERVAL_S = 30.0  # the chart's ServiceMonitor default


def comms_of(rank: int, world: int) -> list[tuple[str, int, int]]:
    pp_size = PP if world >= TP * PP else 1
    dp_size = max(1, world // (TP * pp_size))
    tp, dp, pp = rank % TP, (rank // TP) % dp_size, rank // (TP * dp_size)
    return [
        (f"{0x1000000 + dp + dp_size * pp:016x}", tp, TP),
        (f"{0x2000000 + tp + TP * pp:016x}", dp, dp_size),
        (f"{0x3000000 + tp + TP * dp:016x}", pp, pp_size),
        (f"{0x4000000:016x}", rank, world),
    ]


def fill(store: JobStore, job_metrics: JobMetrics, jobs: int, world: int, windows: int = 3) -> None:
    generator = random.Random(7)
    for index in range(jobs):
        name = f"job-{index}"
        job_metrics.observe(
            "bench",
            name,
            {
                "phase": "Running",
                "health": "Healthy",
                "conditions": [{"type": t, "status": "True" if t == "Running" else "False"} for t in
                               ("Created", "Running", "Succeeded", "Failed", "Hung", "Degraded")],
            },
        )  # fmt: skip
        job_metrics.observe_pods("bench", name, [f"{name}-worker-{pod}" for pod in range(world // RANKS_PER_POD)])
        state = store.get("bench", name)
        for window in range(windows):
            for pod in range(world // RANKS_PER_POD):
                ranks = []
                for rank in range(pod * RANKS_PER_POD, (pod + 1) * RANKS_PER_POD):
                    comms = []
                    for comm_id, comm_rank, size in comms_of(rank, world):
                        wait = 0.001 * generator.uniform(0.7, 1.3)
                        seq = 100 * (window + 1)
                        comms.append(
                            CommWindow(comm_id, comm_rank, size, seq - 99, seq, seq - 99, seq, 0, None,
                                       {"AllReduce": 100}, 0, Quantiles(100, wait, wait * 1.5, wait * 2, wait * 3),
                                       Quantiles(100, 0.02, 0.021, 0.03, 0.04), None)
                        )  # fmt: skip
                    ranks.append(RankWindow(rank, rank % 8, 1000 + rank, f"r{rank}.ring", True, 600, 0, 0, 0,
                                            time.time_ns(), 0.021, comms))  # fmt: skip
                state.add_summary(
                    WindowSummary(1, "bench", name, f"{name}-worker-{pod}", f"gpu-node-{pod}", pod, RANKS_PER_POD,
                                  window, window * 10**9, (window + 1) * 10**9, 0, ranks)
                )  # fmt: skip


def measure(scrapes: int) -> tuple[float, float, int, int]:
    """Median seconds per render of the default registry (as is, heap frozen), bytes, series (sample lines)."""
    medians = []
    for frozen in (False, True):
        if frozen:
            gc.collect()
            gc.freeze()
        times = []
        for _ in range(scrapes):
            started = time.perf_counter()
            body = generate_latest(REGISTRY)
            times.append(time.perf_counter() - started)
        medians.append(statistics.median(times))
        gc.unfreeze()
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    return medians[0], medians[1], len(body), series


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=20)
    args = parser.parse_args()
    RemediationMetrics.default()
    _, base_s, base_bytes, base_series = measure(args.scrapes)
    print(f"baseline (no per-job series): {base_series} series, {base_bytes / 1024:.1f} KiB, {base_s * 1e3:.2f} ms")
    print(f"{'jobs':>5} {'ranks/job':>9} {'series':>7} {'per job':>7} {'KiB':>7} {'ms as is':>9} {'ms frozen':>9} "
          f"{'x base':>7} {'core @30s':>9}")  # fmt: skip
    for jobs, world in ((1, 1024), (50, 24), (50, 1024)):
        store = JobStore()
        job_metrics = JobMetrics(store, JobMetricsSettings())
        fill(store, job_metrics, jobs, world)
        REGISTRY.register(job_metrics)
        try:
            as_is, frozen, size, series = measure(args.scrapes)
        finally:
            REGISTRY.unregister(job_metrics)
        added = series - base_series
        print(
            f"{jobs:>5} {world:>9} {series:>7} {added / jobs:>7.0f} {size / 1024:>7.1f} {as_is * 1e3:>9.2f} "
            f"{frozen * 1e3:>9.2f} {frozen / base_s:>7.1f} {as_is / SCRAPE_INTERVAL_S:>9.3%}"
        )


if __name__ == "__main__":
    main()
