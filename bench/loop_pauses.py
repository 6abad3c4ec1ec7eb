"""Where an event loop's pauses come from: its lag sampled by a ticker, each garbage collection timed by
generation, and named sections of work (the detector's passes) timed, all on one clock, so the longest
pauses can be laid against what ran during them.

Used inside the process under load (bench/operator_scale.py's collector child): ``watch = PauseWatch();
watch.start()`` on the running loop, ``with watch.section("detect"): ...`` around work, ``watch.take()``
for what was seen since the last take (plain data: it crosses a multiprocessing queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

TICK_S = 0.005
"""The ticker's period: lag is how much later than asked for its ``sleep`` returned."""
PAUSE_S = 0.05
"""A lag at least this long is a pause worth laying against what ran during it."""


@dataclass
class Observed:
    """What one watch saw over a stretch: every tick's lag, the pauses, the collections, the sections."""

    lags: list[float] = field(default_factory=list)
    pauses: list[tuple[float, float, float, float]] = field(default_factory=list)
    """(start, end) in ``time.perf_counter`` seconds of each tick late by at least ``PAUSE_S``, with the
    loop thread's CPU seconds and its seconds waiting in the run queue for a CPU (the machine's other
    work, not ours) over that tick."""
    collections: list[tuple[int, float, float, float]] = field(default_factory=list)
    """(generation, start, end, CPU seconds) of every garbage collection."""
    sections: list[tuple[str, float, float]] = field(default_factory=list)
    """(name, start, end) of every timed section."""


class PauseWatch:
    def __init__(self) -> None:
        self.seen = Observed()
        self._collecting = self._collecting_cpu = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        gc.callbacks.append(self._collection)
        self._task = asyncio.get_running_loop().create_task(self._tick())

    def _collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._collecting, self._collecting_cpu = time.perf_counter(), time.thread_time()
        else:
            cpu = time.thread_time() - self._collecting_cpu
            self.seen.collections.append((info["generation"], self._collecting, time.perf_counter(), cpu))

    async def _tick(self) -> None:
        while True:
            asked, cpu, waited = time.perf_counter(), time.thread_time(), run_queue_seconds()
            await asyncio.sleep(TICK_S)
            woke = time.perf_counter()
            lag = woke - asked - TICK_S
            self.seen.lags.append(lag)
            if lag >= PAUSE_S:
                spent, queued = time.thread_time() - cpu, run_queue_seconds() - waited
                self.seen.pauses.append((asked + TICK_S, woke, spent, queued))

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seen.sections.append((name, began, time.perf_counter()))

    def take(self) -> Observed:
        seen, self.seen = self.seen, Observed()
        return seen


def run_queue_seconds() -> float:
    """Seconds this thread has waited for a CPU while runnable (``/proc/thread-self/schedstat``)."""
    try:
        with open("/proc/thread-self/schedstat") as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def overlap(start: float, end: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)


def quantile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))] if ordered else float("nan")


def summary(seen: Observed, longest: int = 5) -> dict[str, Any]:
    """The loop's lag quantiles; per generation the collections' count, total and longest; the timed
    sections' count and longest; and the ``longest`` pauses, each with the loop thread's CPU and its wait
    for a CPU within it, and the time collections of each generation and each section took within it
    (wall: a collection descheduled halfway counts whole)."""
    figures: dict[str, Any] = {
        "lag_p50_ms": 1e3 * quantile(seen.lags, 0.5),
        "lag_p99_ms": 1e3 * quantile(seen.lags, 0.99),
        "lag_max_ms": 1e3 * max(seen.lags, default=float("nan")),
        "pauses": len(seen.pauses),
        "pauses_ms": 1e3 * sum(end - start for start, end, _, _ in seen.pauses),
        "pauses_queued_ms": 1e3 * sum(queued for *_, queued in seen.pauses),
    }
    for generation in range(3):
        spans = [end - start for g, start, end, _ in seen.collections if g == generation]
        cpu = [spent for g, _, _, spent in seen.collections if g == generation]
        figures[f"gc{generation}_count"] = len(spans)
        figures[f"gc{generation}_ms"] = 1e3 * sum(spans)
        figures[f"gc{generation}_max_ms"] = 1e3 * max(spans, default=0.0)
        figures[f"gc{generation}_cpu_max_ms"] = 1e3 * max(cpu, default=0.0)
    for name in sorted({name for name, _, _ in seen.sections}):
        spans = [end - start for n, start, end in seen.sections if n == name]
        figures[f"{name}_count"] = len(spans)
        figures[f"{name}_max_ms"] = 1e3 * max(spans)
    described = []
    for start, end, spent, queued in sorted(seen.pauses, key=lambda pause: pause[0] - pause[1])[:longest]:
        parts = [f"CPU {1e3 * spent:.0f}", f"waiting for a CPU {1e3 * queued:.0f}"]
        for generation in range(3):
            took = overlap(start, end, [(a, b) for g, a, b, _ in seen.collections if g == generation])
            if took:
                parts.append(f"GC gen {generation} {1e3 * took:.0f}")
        for name in sorted({name for name, _, _ in seen.sections}):
            took = overlap(start, end, [(a, b) for n, a, b in seen.sections if n == name])
            if took:
                parts.append(f"{name} {1e3 * took:.0f}")
        described.append(f"{1e3 * (end - start):.0f} ms ({', '.join(parts)})")
    figures["longest_pauses"] = "; ".join(described)
    return figures


def merged(parts: list[Observed]) -> Observed:
    whole = Observed()
    for part in parts:
        whole.lags += part.lags
        whole.pauses += part.pauses
        whole.collections += part.collections
        whole.sections += part.sections
    return whole
