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

Each worker is one process and one socket to it, read and written by the event loop itself (length-
prefixed pickles): no executor, so no feeder and result threads taking the GIL from the loop and no
future crossing threads per batch (until 2026-11-29 a ProcessPoolExecutor: its two threads took 7-15% of
the loop process's CPU at 64,000 ranks). A worker that dies loses only the batch it held (answered 503,
the sidecar retries); another is started in its place.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import struct
import typing
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

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


Waiting = tuple[Body, asyncio.Future[Parsed]]
"""A body and the future its request awaits."""
FRAME = struct.Struct("!I")
"""Each frame between the loop and a worker: its length, then a pickle (a batch of bodies, or its results)."""


class MessageParser:
    """Parses bodies in ``workers`` processes (0: small plain bodies on the event loop, the others in a
    thread)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._running: list[_Worker] = []
        self._waiting: list[Waiting] = []
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    async def start(self) -> None:
        """Start the workers and wait until they answer (a few seconds on a busy machine), so the
        first bodies do not wait for them."""
        self._closed = False
        self._start_missing()
        await asyncio.gather(*(worker.ready for worker in self._running))

    def processes(self) -> list[BaseProcess]:
        """The worker processes running now."""
        return [worker.process for worker in self._running]

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
        self._closed = True
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None
        for worker in self._running:
            worker.stop()
        self._running.clear()
        for _, answer in self._waiting:
            answer.cancel()
        self._waiting.clear()

    def _send(self) -> None:
        """Batches to idle workers, bodies whose requests are gone left out."""
        self._start_missing()
        for worker in self._running:
            if not self._waiting:
                return
            if not worker.idle:
                continue
            batch = [(body, answer) for body, answer in self._waiting[:BATCH_MAX] if not answer.done()]
            del self._waiting[:BATCH_MAX]
            if batch:
                worker.take(batch)

    def _start_missing(self) -> None:
        """As many workers as asked, a new one in the place of one that died."""
        while not self._closed and len(self._running) < self.workers:
            self._running.append(_Worker(self))

    def _lost(self, worker: _Worker) -> None:
        """``worker`` died (OOM-killed?), or could not start: what it held is answered 503 (the sidecar
        retries), and when it never started the bodies waiting for it too (its replacement may not start
        either)."""
        if worker not in self._running:
            return  # closed
        self._running.remove(worker)
        log.error("collector: a message parsing worker ended (exit code %s); starting a new one", worker.exit_code())
        busy = Refusal(503, "the collector could not parse the message now; retry")
        failed = list(worker.batch or [])
        if not worker.ready.done():
            worker.ready.set_exception(RuntimeError("a message parsing worker ended before it was ready"))
            worker.ready.exception()  # retrieved: start() raises it, or nobody waits for it
            failed += self._waiting
            self._waiting.clear()
        for _, answer in failed:
            if not answer.done():
                answer.set_result(busy)
        self._send()


class _Worker(asyncio.Protocol):
    """One worker process and the loop's end of its socket: one batch at a time out, its results back."""

    def __init__(self, parser: MessageParser) -> None:
        self.parser = parser
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = loop.create_future()
        """Done when the worker first answers (an empty batch): it has started and imported what it needs."""
        self.batch: list[Waiting] | None = None
        """The batch in the worker now (None: idle)."""
        self._received = bytearray()
        self._transport: asyncio.Transport | None = None
        mine, its = socket.socketpair()
        self.process = multiprocessing.get_context("spawn").Process(
            target=_serve, args=(its, os.getpid()), name="rankwatch-parse", daemon=True
        )
        self.process.start()
        its.close()
        self._connecting = loop.create_task(loop.connect_accepted_socket(lambda: self, mine))

    @property
    def idle(self) -> bool:
        return self.batch is None and self.ready.done() and self._transport is not None

    def take(self, batch: list[Waiting]) -> None:
        self.batch = batch
        sent = pickle.dumps([body for body, _ in batch], protocol=pickle.HIGHEST_PROTOCOL)
        assert self._transport is not None
        self._transport.writelines((FRAME.pack(len(sent)), sent))

    def stop(self) -> None:
        """End the worker now (the operator stops): what it held is cancelled with its requests."""
        self._connecting.cancel()
        if self._transport is not None:
            self._transport.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(1)

    def exit_code(self) -> int | None:
        """How it ended (None: not reaped yet; its socket closes as it ends, a little before)."""
        return self.process.exitcode

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = typing.cast(asyncio.Transport, transport)  # uvloop's are not asyncio's subclasses

    def data_received(self, data: bytes) -> None:
        self._received += data
        while len(self._received) >= FRAME.size:
            (length,) = FRAME.unpack_from(self._received)
            end = FRAME.size + length
            if len(self._received) < end:
                return
            with memoryview(self._received) as view:
                results = pickle.loads(view[FRAME.size : end])
            del self._received[:end]
            self._answer(results)

    def connection_lost(self, error: Exception | None) -> None:
        self._transport = None
        self.parser._lost(self)

    def _answer(self, results: list[Parsed]) -> None:
        if not self.ready.done():  # its first answer: the empty batch it sends when it has started
            self.ready.set_result(None)
        else:
            batch, self.batch = self.batch or [], None
            for (_, answer), parsed in zip(batch, results, strict=True):
                if not answer.done():
                    answer.set_result(parsed)
        self.parser._send()


def _serve(connection: socket.socket, parent: int) -> None:
    """A worker: batches of bodies in, their results out, until the operator closes its end."""
    _end_with(parent)
    with connection:
        _write(connection, parse_batch([]))  # started: the operator may send bodies
        while (batch := _read(connection)) is not None:
            _write(connection, parse_batch(batch))


def _read(connection: socket.socket) -> list[Body] | None:
    """The next batch, None when the operator has closed its end."""
    head = _read_exactly(connection, FRAME.size)
    if head is None:
        return None
    (length,) = FRAME.unpack(head)
    body = _read_exactly(connection, length)
    return None if body is None else pickle.loads(body)


def _read_exactly(connection: socket.socket, count: int) -> bytearray | None:
    received = bytearray(count)
    view, got = memoryview(received), 0
    while got < count:
        one = connection.recv_into(view[got:])
        if not one:
            return None
        got += one
    return received


def _write(connection: socket.socket, results: list[Parsed]) -> None:
    sent = pickle.dumps(results, protocol=pickle.HIGHEST_PROTOCOL)
    connection.sendall(FRAME.pack(len(sent)) + sent)


PR_SET_PDEATHSIG = 1


def _end_with(parent: int) -> None:
    """In a worker: be killed when the operator's process ends, however it ends (a SIGKILLed operator
    would otherwise leave its workers waiting for work forever)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        log.warning("parsing worker: prctl(PR_SET_PDEATHSIG) failed (errno %d)", ctypes.get_errno())
    if os.getppid() != parent:  # it ended before the signal was asked for
        os._exit(0)
