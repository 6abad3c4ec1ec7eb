"""The operator's garbage-collector settings, for a large, long-lived state under a stream of requests.

The job states of 64,000 ranks are about a million container objects that live for hours; requests
in flight (hundreds at once, waiting for their bodies to be checked) and each detector pass hold
thousands of young objects. With Python's default thresholds (a young collection every 700
allocations) those young objects are caught alive and promoted, and every time the promoted ones
reach a quarter of the old generation a full collection walks the whole state: at 16,000 ranks
1.6 full collections per 5 s window, most of the event loop's time (bench/operator_scale.py, GC ms).
Collecting the young generation every 50,000 allocations lets request and pass garbage die by
reference counting first (the state has no reference cycles), so almost nothing is promoted.

What survives a middle or a full collection is frozen (``gc.freeze``): later collections do not walk
it. Freezing only after full collections (until 2026-11-29) left the full collections themselves: in
the whole operator at 64,000 ranks (kopf's pod bodies, the pod index and the job states: over a
million objects) each paused the event loop for 1.1-2.3 s (bench/cluster_density.py
--sidecar-windows), and in the collector alone it was the longest pause of a run (412-521 ms of CPU,
bench/operator_scale.py). An object that lived through two collections is long-lived here; once
frozen, nothing reaches the old generation and no full collection walks the state. Frozen objects are
still freed by reference counting when they are replaced; only a reference cycle among them that
became garbage stays (the bench counts them at its end), so every ``THAW_SECONDS`` they are handed
back and collected at once: one deliberate full collection, timed and logged.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

log = logging.getLogger(__name__)

THRESHOLDS = (50_000, 5, 10)
"""Young collection every 50,000 net allocations; the middle every 5 young ones (each walks what the
young ones promoted since: fewer at a time, shorter pauses); the 25% rule of CPython decides when the
full one runs."""

THAW_SECONDS = 1800.0
"""How often the frozen objects are handed back and collected (one full collection of everything)."""


def tune() -> None:
    gc.set_threshold(*THRESHOLDS)
    if _freeze_survivors not in gc.callbacks:
        gc.callbacks.append(_freeze_survivors)


def _freeze_survivors(phase: str, info: dict[str, Any]) -> None:
    """Right after a middle or full collection, what lived is long-lived: freezing it keeps the old
    generation empty, so no later collection walks it (cyclic garbage among it waits for the thaw)."""
    if phase == "stop" and info["generation"] >= 1:
        gc.freeze()


def thaw() -> tuple[int, int, float]:
    """Hand the frozen objects back and collect them all now (the next middle collection would freeze
    them again, garbage included): (objects thawed, unreachable found, seconds of CPU it took)."""
    frozen = gc.get_freeze_count()
    started = time.thread_time()
    gc.unfreeze()
    found = gc.collect()
    return frozen, found, time.thread_time() - started


async def thaw_periodically(interval: float = THAW_SECONDS) -> None:
    """Thaw and collect every ``interval`` seconds (runs until cancelled)."""
    while True:
        await asyncio.sleep(interval)
        frozen, found, seconds = thaw()
        log.info("garbage collection: %d frozen objects walked in %.0f ms, %d unreachable freed", frozen,
                 1e3 * seconds, found)  # fmt: skip
