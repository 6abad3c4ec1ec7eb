"""Parsing the sidecars' messages off the operator's event loop, in worker processes.

At 64,000 ranks the collector takes ~1,600 summaries a second; the event loop is one core, shared by
HTTP, the job states and the detector, so checking each body's JSON there (and the GIL keeps threads
on that core) makes the loop the bottleneck. Here a body is checked against the protocol in a worker
process and comes back as what the collector needs of it: a :class:`SummaryDigest` (plain tuples,
cheap to send back; the summary's dataclasses cost as much to unpickle as to parse) or a
:class:`StallReport`, or a :class:`Refusal` with the HTTP status and the message naming the bad field.

Bodies arrive as sent (gzip'd) and are inflated here too, one at a time per worker and to at most
``protocol.MAX_DECODED_BYTES``: the loop holds only compressed bytes (its in-flight budget counts
them), and however many gzip bombs arrive together, each worker holds at most one inflated body.

Bodies are sent in batches: while a batch is in a worker, the bodies that arrive wait and go together
as the next one, so the loop's cost per body stays small under load while a lone body is sent at once.
A body is parsed once its bytes are held against the collector's in-flight budget, so what waits here
is bounded by that budget. Workers are spawned (never a fork of the operator's threads) and die with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import multiprocessing
import os
import signal
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from rankwatch import protocol
from rankwatch.operator.diagnosis.ingest.job_state import SummaryDigest

log = logging.getLogger(__name__)

BATCH_MAX = 256
"""Bodies per batch sent to a worker."""
INLINE_MAX_BYTES = 64 << 10
"""Without workers, plain bodies larger than this, and every gzip'd one (it may inflate to
``protocol.MAX_DECODED_BYTES``), are parsed in one thread, one at a time, rather than on the loop."""


@dataclass(frozen=True)
class Refusal:
    """A body the protocol refuses: the HTTP status to answer and why."""

    status: int
    error: str


Parsed = SummaryDigest | protocol.StallReport | Refusal
Body = tuple[bytes, str | None, str]
"""(the body as received, its Content-Encoding, "summary" or "stall")."""


def parse_body(raw: bytes, content_encoding: str | None, kind: str) -> Parsed:
    """One body as sent: gzip inflated and size limits (a bomb is refused with 413 once it passes
    ``protocol.MAX_DECODED_BYTES``), then the protocol's checks; a refusal names what to fix."""
    try:
        body = protocol.decode_body(raw, content_encoding)
    except protocol.ProtocolError as error:
        status = 413 if "over the limit" in str(error) or "more than" in str(error) else 400
        return Refusal(status, str(error))
    try:
        if kind == "summary":
            return SummaryDigest.of(protocol.checked_summary(body))
        return protocol.parse_stall(body)
    except protocol.ProtocolError as error:
        return Refusal(422, str(error))


def parse_batch(bodies: list[Body]) -> list[Parsed]:
    """Run in a worker: every body of a batch, each on its own (one bad body refuses only itself)."""
    return [parse_body(*body) for body in bodies]


class MessageParser:
    """Parses bodies in ``workers`` processes (0: small plain bodies on the event loop, the others in a
    thread)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._waiting: list[tuple[Body, asyncio.Future[Parsed]]] = []
        self._batches_out = 0
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None

    async def start(self) -> None:
        """Start the workers and wait until they answer (a few seconds on a busy machine), so the
        first bodies do not wait for them."""
        if self.workers > 0:
            pool = self._workers()
            await asyncio.gather(*(asyncio.wrap_future(pool.submit(parse_batch, [])) for _ in range(self.workers)))

    async def parse(self, raw: bytes, content_encoding: str | None, kind: str) -> Parsed:
        if self.workers <= 0:
            if len(raw) > INLINE_MAX_BYTES or raw[:2] == protocol.GZIP_MAGIC:
                if self._thread is None:
                    self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rankwatch-parse")
                return await asyncio.get_running_loop().run_in_executor(
                    self._thread, parse_body, raw, content_encoding, kind
                )
            return parse_body(raw, content_encoding, kind)
        answer: asyncio.Future[Parsed] = asyncio.get_running_loop().create_future()
        self._waiting.append(((raw, content_encoding, kind), answer))
        self._send()
        return await answer

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        for _, answer in self._waiting:
            answer.cancel()
        self._waiting.clear()

    def _send(self) -> None:
        """Batches to idle workers, bodies whose requests are gone left out."""
        while self._waiting and self._batches_out < self.workers:
            batch = [(body, answer) for body, answer in self._waiting[:BATCH_MAX] if not answer.done()]
            del self._waiting[:BATCH_MAX]
            if not batch:
                continue
            bodies = [body for body, _ in batch]
            pool = self._workers()
            try:
                submitted = pool.submit(parse_batch, bodies)
            except BrokenProcessPool as error:  # found broken before any batch of ours came back
                self._restart(pool, error)
                pool = self._workers()
                submitted = pool.submit(parse_batch, bodies)
            self._batches_out += 1
            done = asyncio.wrap_future(submitted)
            done.add_done_callback(lambda future, batch=batch, pool=pool: self._answer(future, batch, pool))

    def _answer(
        self,
        future: asyncio.Future[list[Parsed]],
        batch: list[tuple[Body, asyncio.Future[Parsed]]],
        pool: concurrent.futures.ProcessPoolExecutor,
    ) -> None:
        self._batches_out -= 1
        error = None if future.cancelled() else future.exception()
        if future.cancelled() or error is not None:
            if isinstance(error, BrokenProcessPool):
                self._restart(pool, error)
            else:
                log.error("collector: parsing a batch of messages failed: %r", error)
            busy = Refusal(503, "the collector could not parse the message now; retry")
            for _, answer in batch:
                if not answer.done():
                    answer.set_result(busy)
        else:
            for (_, answer), parsed in zip(batch, future.result(), strict=True):
                if not answer.done():
                    answer.set_result(parsed)
        self._send()

    def _restart(self, pool: concurrent.futures.ProcessPoolExecutor, error: BaseException) -> None:
        """A worker of ``pool`` died (OOM-killed?): it is unusable; new workers start with the next batch
        (unless a batch of an earlier pool failed late: the current one is kept)."""
        if self._pool is pool:
            log.error("collector: a message parsing worker died (%s); starting new ones", error)
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _workers(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_end_with,
                initargs=(os.getpid(),),
            )
        return self._pool


PR_SET_PDEATHSIG = 1


def _end_with(parent: int) -> None:
    """In a worker: be killed when the operator's process ends, however it ends (a SIGKILLed operator
    would otherwise leave its workers waiting for work forever)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        log.warning("parsing worker: prctl(PR_SET_PDEATHSIG) failed (errno %d)", ctypes.get_errno())
    if os.getppid() != parent:  # it ended before the signal was asked for
        os._exit(0)
