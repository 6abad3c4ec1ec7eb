"""The operator's garbage-collector settings, for a large, long-lived state under a stream of requests.

The job states of 64,000 ranks are about a million container objects that live for hours; requests
in flight (hundreds at once, waiting for their bodies to be checked) and each detector pass hold
thousands of young objects. With Python's default thresholds (a young collection every 700
allocations) those young objects are caught alive and promoted, and every time the promoted ones
reach a quarter of the old generation a full collection walks the whole state: at 16,000 ranks
1.6 full collections per 5 s window, most of the event loop's time (bench/operator_scale.py, GC ms).
Collecting the young generation every 50,000 allocations lets request and pass garbage die by
reference counting first (the state has no reference cycles), so almost nothing is promoted.

What survives a full collection is frozen (``gc.freeze``): later collections do not walk it. In the
whole operator at 64,000 ranks (kopf's pod bodies, the pod index and the job states: over a million
objects) each full collection paused the event loop for 1.1-2.3 s and the collector's p99 latency
was 1.9-2.5 s (bench/cluster_density.py --sidecar-windows). Frozen objects are still freed by
reference counting when they are replaced; only a reference cycle among them that became garbage
would stay, so they are thawed every ``THAW_SECONDS`` and the next full collection walks everything
once and freezes again.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

THRESHOLDS = (50_000, 5, 10)
"""Young collection every 50,000 net allocations; the middle every 5 young ones (each walks what the
young ones promoted since: fewer at a time, shorter pauses); the 25% rule of CPython decides when the
full one runs."""

THAW_SECONDS = 1800.0
"""How often the frozen objects are handed back to the collector (one long full collection)."""


def tune() -> None:
    gc.set_threshold(*THRESHOLDS)
    if _freeze_after_full not in gc.callbacks:
        gc.callbacks.append(_freeze_after_full)


def _freeze_after_full(phase: str, info: dict[str, Any]) -> None:
    """Right after a full collection no garbage cycle is left: freezing what lived loses nothing."""
    if phase == "stop" and info["generation"] == 2:
        gc.freeze()


async def thaw_periodically(interval: float = THAW_SECONDS) -> None:
    """Hand the frozen objects back to the collector every ``interval`` seconds (runs until cancelled)."""
    while True:
        await asyncio.sleep(interval)
        gc.unfreeze()
