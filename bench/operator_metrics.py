"""Cost of a Prometheus scrape of the operator's /metrics, and its series count, with the per-job series.

The operator's state is built as the collector builds it (``JobState.add_summary`` with the window
summaries of bench/operator_cpu.py: 8 ranks per pod, 4 communicators per rank: TP 8, DP, PP 4,
world), each job's status as
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

from operator_cpu import summaries
from prometheus_client import REGISTRY, generate_latest

from rankwatch import protocol
from rankwatch.operator.diagnosis.ingest.job_state import JobStore
from rankwatch.operator.diagnosis.report.job_metrics import JobMetrics, JobMetricsSettings
from rankwatch.operator.operator_metrics import OperatorMetrics

SCRAPE_INTERVAL_S = 30.0  # the chart's ServiceMonitor default
RUNNING = {
    "phase": "Running",
    "health": "Healthy",
    "conditions": [
        {"type": t, "status": "True" if t == "Running" else "False"}
        for t in ("Created", "Running", "Succeeded", "Failed", "Hung", "Degraded")
    ],
}


def fill(store: JobStore, job_metrics: JobMetrics, jobs: int, world: int, windows: int = 3) -> None:
    """``jobs`` jobs of ``world`` ranks, each with ``windows`` windows of summaries from every pod, parsed
    by the protocol module as the collector parses them (bench/operator_cpu.py builds them)."""
    generator = random.Random(7)
    parsed = [
        [protocol.parse_summary(protocol.decode_body(body, "gzip")) for _, body in summaries(world, w, generator)]
        for w in range(1, windows + 1)
    ]
    for index in range(jobs):
        name = f"job-{index}"
        job_metrics.observe("bench", name, RUNNING)
        job_metrics.observe_pods("bench", name, [summary.pod for summary in parsed[0]])
        state = store.get("bench", name)
        for window in parsed:
            for summary in window:
                state.add_summary(summary)


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
    OperatorMetrics.of()  # the operator's own series, as at its start
    _, base_s, base_bytes, base_series = measure(args.scrapes)
    print(f"baseline (no per-job series): {base_series} series, {base_bytes / 1024:.1f} KiB, {base_s * 1e3:.2f} ms")
    print(f"{'jobs':>5} {'ranks/job':>9} {'series':>7} {'per job':>7} {'KiB':>7} {'ms as is':>9} {'ms frozen':>9} "
          f"{'x base':>7} {'core @30s':>9}")  # fmt: skip
    for jobs, world in ((1, 1024), (50, 32), (50, 1024)):
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
