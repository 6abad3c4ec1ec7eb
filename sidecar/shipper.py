"""Send summaries and stall reports to the operator's collector without ever holding up the reader.

``submit_*`` only appends to a bounded deque (O(1), never waits); one background task sends the
oldest message, stall reports first. A full summary queue drops its oldest summary; the count of
dropped summaries rides on the next summary the collector accepts. Failures (connection refused,
timeout, 401/403, 429, 5xx) are retried with capped exponential backoff and jitter; 400/413/422
refuse a message for good and it is dropped (logged, counted).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from rankwatch import protocol
from rankwatch.protocol import StallReport, WindowSummary

log = logging.getLogger(__name__)

PERMANENT_STATUSES = frozenset({400, 404, 409, 413, 422})


@dataclass
class ShipperStats:
    summaries_sent: int = 0
    stalls_sent: int = 0
    summaries_dropped: int = 0  # by the full queue
    rejected: int = 0  # refused for good by the collector
    failures: int = 0  # attempts that will be retried
    last_status: int = 0  # HTTP status of the last answer, 0 for none / connection error


@dataclass
class Backoff:
    initial: float = 0.5
    cap: float = 30.0

    def delay(self, attempt: int) -> float:
        """Exponential, capped, with "equal jitter": half fixed, half random (never a thundering herd)."""
        ceiling = min(self.cap, self.initial * 2**attempt)
        return ceiling / 2 + random.uniform(0, ceiling / 2)


class Shipper:
    def __init__(
        self,
        collector_url: str,
        namespace: str,
        job: str,
        token: Callable[[], str | None],
        queue_size: int = 120,
        timeout: float = 10.0,
        backoff: Backoff | None = None,
    ) -> None:
        base = collector_url.rstrip("/")
        self.summaries_url = base + protocol.summaries_path(namespace, job)
        self.stalls_url = base + protocol.stalls_path(namespace, job)
        self._token = token
        self._summaries: collections.deque[WindowSummary] = collections.deque(maxlen=max(1, queue_size))
        self._stalls: collections.deque[StallReport] = collections.deque(maxlen=16)
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._backoff = backoff or Backoff()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._unreported_drops = 0
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None
        self.stats = ShipperStats()

    # -- the reader's side: never waits ------------------------------------------------------------
    def submit_summary(self, summary: WindowSummary) -> None:
        if len(self._summaries) == self._summaries.maxlen:
            self.stats.summaries_dropped += 1
            self._unreported_drops += 1
        self._summaries.append(summary)  # a full deque pushes out its oldest
        self._kick()

    def submit_stall(self, report: StallReport) -> None:
        self._stalls.append(report)
        self._kick()

    def queued(self) -> int:
        return len(self._summaries) + len(self._stalls)

    def _kick(self) -> None:
        self._idle.clear()
        self._wake.set()

    # -- the sending task ----------------------------------------------------------------------------
    def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        self._task = asyncio.create_task(self._run(), name="rankwatch-shipper")

    async def drain(self, timeout: float) -> bool:
        """Wait until everything queued was sent (or refused); False when the time ran out."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session:
            await self._session.close()

    async def _run(self) -> None:
        attempt = 0
        while True:
            message = self._stalls[0] if self._stalls else self._summaries[0] if self._summaries else None
            if message is None:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            drops = self._unreported_drops if isinstance(message, WindowSummary) else 0
            outcome = await self._send(message, drops)
            if outcome == "retry":
                if not attempt:
                    log.warning(
                        "the collector did not take a %s (%s); retrying with backoff, queueing at most %d summaries",
                        type(message).__name__,
                        f"HTTP {self.stats.last_status}" if self.stats.last_status else "unreachable",
                        self._summaries.maxlen,
                    )
                self.stats.failures += 1
                await asyncio.sleep(self._backoff.delay(attempt))
                attempt += 1
                continue
            if attempt:
                log.info("the collector took a message after %d failed attempts", attempt)
            attempt = 0
            if outcome == "sent" and isinstance(message, WindowSummary):
                self._unreported_drops -= drops
            self._discard(message, delivered=outcome == "sent")

    def _discard(self, message: WindowSummary | StallReport, delivered: bool) -> None:
        queue = self._stalls if isinstance(message, StallReport) else self._summaries
        if queue and queue[0] is message:
            queue.popleft()
        elif delivered and isinstance(message, WindowSummary):
            # A full queue pushed it out while it was on the wire and counted it dropped; it arrived, so it
            # was not lost (that drop is still unreported: it happened after ``drops`` was taken).
            self.stats.summaries_dropped -= 1
            self._unreported_drops -= 1

    async def _send(self, message: WindowSummary | StallReport, drops: int) -> str:
        """'sent', 'refused' (drop it) or 'retry'."""
        if isinstance(message, WindowSummary):
            url = self.summaries_url
            body = protocol.encode(dataclasses.replace(message, dropped_summaries=drops))
        else:
            url = self.stalls_url
            body = protocol.encode(message)
        headers = {
            "Content-Type": protocol.CONTENT_TYPE,
            "Content-Encoding": protocol.CONTENT_ENCODING,
        }
        token = self._token()
        if token:
            headers["Authorization"] = protocol.bearer(token)
        assert self._session is not None
        try:
            async with self._session.post(url, data=body, headers=headers) as response:
                self.stats.last_status = response.status
                text = (await response.text())[:200] if response.status >= 300 else ""
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            self.stats.last_status = 0
            log.debug("POST %s failed: %r", url, error)
            return "retry"
        if response.status < 300:
            if isinstance(message, WindowSummary):
                self.stats.summaries_sent += 1
            else:
                self.stats.stalls_sent += 1
            return "sent"
        if response.status in PERMANENT_STATUSES:
            self.stats.rejected += 1
            log.error("the collector refused a %s for good (%d): %s", type(message).__name__, response.status, text)
            return "refused"
        if response.status in (401, 403):
            log.debug("the collector refused the token (%d): %s", response.status, text)
        return "retry"
