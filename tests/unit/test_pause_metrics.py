"""The operator's /metrics say how long its event loop stalls and how long each garbage collection takes:
a loop blocked for 0.3 s shows a lag of at least that, a collection is counted under its generation."""

from __future__ import annotations

import asyncio
import gc
import time

from prometheus_client import CollectorRegistry

from rankwatch.operator.diagnosis.metrics import DiagnosisMetrics
from rankwatch.operator.pause_metrics import PauseMetrics


def sample(registry: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float:
    return registry.get_sample_value(name, labels or {}) or 0.0


async def test_a_blocked_loop_and_each_collection_show_on_metrics():
    registry = CollectorRegistry()
    metrics = DiagnosisMetrics(registry)
    pauses = PauseMetrics(metrics.event_loop_lag_seconds, metrics.gc_pause_seconds)
    pauses.start()
    try:
        await asyncio.sleep(0)  # the ticker asks to wake in 0.1 s
        time.sleep(0.3)  # the loop blocked, as by a long collection or a long detector pass
        deadline = time.monotonic() + 60
        while sample(registry, "rankwatch_event_loop_lag_seconds_count") == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert sample(registry, "rankwatch_event_loop_lag_seconds_sum") >= 0.19, "0.3 s blocked, 0.1 s asked"
        young = sample(registry, "rankwatch_gc_pause_seconds_count", {"generation": "0"})
        gc.collect(0)
        gc.collect(2)
        assert sample(registry, "rankwatch_gc_pause_seconds_count", {"generation": "0"}) == young + 1
        assert sample(registry, "rankwatch_gc_pause_seconds_count", {"generation": "2"}) >= 1
    finally:
        await pauses.stop()
    assert pauses._collection not in gc.callbacks
