"""The operator's collector as a process of its own, for the hostile-input tests: the real
``Collector`` with the job team-a/llama (16 ranks on 2 pods). The one stand-in is where the token comes
from: the job's Secret needs an API server; here it is the value of ``HOSTILE_TOKEN``.

Prints ``port <N>`` once listening; runs until killed."""

from __future__ import annotations

import asyncio
import os
import sys

from rankwatch.operator.config import CollectorSettings
from rankwatch.operator.diagnosis.ingest.collector import Collector
from rankwatch.operator.diagnosis.ingest.job_state import JobStore, StateLimits
from rankwatch.operator.operator_metrics import OperatorMetrics

JOB = ("team-a", "llama")


async def main() -> None:
    token = os.environ["HOSTILE_TOKEN"]

    async def tokens(namespace: str, name: str, stale: bool = False) -> str | None:
        return token if (namespace, name) == JOB else None

    def jobs(namespace: str, name: str) -> StateLimits | None:
        return StateLimits.for_job(world_size=16, replicas=2) if (namespace, name) == JOB else None

    settings = CollectorSettings(
        host="127.0.0.1",
        port=0,
        rate_per_job=float(os.environ.get("HOSTILE_RATE", "200")),
        burst_per_job=float(os.environ.get("HOSTILE_BURST", "2000")),
        body_timeout_s=float(os.environ.get("HOSTILE_BODY_TIMEOUT", "15")),
        idle_timeout_s=float(os.environ.get("HOSTILE_IDLE_TIMEOUT", "15")),
    )
    metrics = OperatorMetrics.of().diagnosis  # served at /metrics, as the operator makes them at start
    collector = Collector(JobStore(on_drop=metrics.dropped), tokens, settings, jobs=jobs, metrics=metrics)
    await collector.start()
    print(f"port {collector.port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
