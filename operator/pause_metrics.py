"""The event loop's pauses on /metrics: how late a ticker on the loop wakes (every answer of the
collector waits as long) and how long each garbage collection takes, by generation.

Why: at 64,000 ranks the collector's tail latency is its loop's pauses, not its work per summary
(bench/operator_scale.py); these two series say from a live operator which pauses it has, and let the
combined bench (bench/cluster_density.py --sidecar-windows) show them for the whole operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from typing import Any

from prometheus_client import Histogram

TICK_S = 0.1
"""How often the ticker asks to wake; its lag is how much later it did."""


class PauseMetrics:
    def __init__(self, loop_lag: Histogram, collections: Histogram) -> None:
        self.loop_lag = loop_lag
        self.collections = collections
        self._started = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """On the running loop: the ticker, and the timing of every collection of this process."""
        if self._collection not in gc.callbacks:
            gc.callbacks.append(self._collection)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._tick(), name="loop-lag")

    async def stop(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._collection)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.collections.labels(str(info["generation"])).observe(time.perf_counter() - self._started)

    async def _tick(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(TICK_S)
            self.loop_lag.observe(max(0.0, time.perf_counter() - asked - TICK_S))
