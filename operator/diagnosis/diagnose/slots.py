"""At most N diagnoses at once across all jobs; the others wait, most severe first.

A switch failure can make twenty jobs suspicious in the same minute. Each diagnosis fetches dumps and
runs an analysis worker with its own memory budget (``worker.py``), so the operator's memory is
bounded by the number running, not by the number of jobs. Waiting requests are served by severity
(a hang before a straggler before a slowdown), then by age; one job is never diagnosed twice at
once and waits in one place (a more severe suspicion raises its place in the queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

Key = tuple[str, str]


@dataclass(order=True)
class _Waiting:
    severity: int
    order: int
    start: Callable[[], Awaitable[None]] = field(compare=False)


class DiagnosisSlots:
    def __init__(self, concurrency: int, on_change: Callable[[int, int], None] | None = None) -> None:
        self.concurrency = concurrency
        self.running: dict[Key, asyncio.Task[None]] = {}
        self.waiting: dict[Key, _Waiting] = {}
        self._order = itertools.count()
        self._on_change = on_change or (lambda running, waiting: None)

    def request(self, key: Key, severity: int, start: Callable[[], Awaitable[None]]) -> None:
        """Run ``start()`` for ``key`` when a slot is free; nothing if it runs already."""
        if key in self.running:
            return
        waiting = self.waiting.get(key)
        if waiting is None:
            self.waiting[key] = _Waiting(severity, next(self._order), start)
        elif severity < waiting.severity:
            waiting.severity, waiting.start = severity, start
        self._dispatch()

    def busy(self, key: Key) -> bool:
        return key in self.running or key in self.waiting

    def cancel(self, key: Key) -> None:
        self.waiting.pop(key, None)
        task = self.running.get(key)
        if task is not None:
            task.cancel()
        self._changed()

    async def close(self) -> None:
        self.waiting.clear()
        tasks = list(self.running.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _dispatch(self) -> None:
        while self.waiting and len(self.running) < self.concurrency:
            key = min(self.waiting, key=self.waiting.__getitem__)
            start = self.waiting.pop(key).start
            self.running[key] = asyncio.create_task(self._run(key, start), name=f"diagnosis {key[0]}/{key[1]}")
        self._changed()

    async def _run(self, key: Key, start: Callable[[], Awaitable[None]]) -> None:
        try:
            await start()
        except asyncio.CancelledError:
            raise
        except Exception:  # the caller handles its own failures; this keeps the slot from leaking
            log.exception("diagnosis of TrainingJob %s/%s failed", *key)
        finally:
            self.running.pop(key, None)
            self._dispatch()

    def _changed(self) -> None:
        self._on_change(len(self.running), len(self.waiting))
