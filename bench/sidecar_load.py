"""A cheap load generator that plays many sidecars against the collector, in processes of its own.

Why: at 64,000 ranks the operator takes 1,600 summaries/s; a sender built on aiohttp's client in the
bench's own process cost about a core of the machine's two, so the bench showed its own limit, not
the operator's. Here each sender process owns a share of the pods, holds every request of every
window as the bytes it will write (head and gzip'd body, made before the clock starts: the real
sidecar protocol, the job's bearer token, window numbers advancing), writes them over keep-alive
connections with a minimal HTTP/1.1 client (asyncio protocols, one request in flight per
connection), and measures its own CPU so the bench can say what the operator, not the sender, used.

Schedule: pod ``i`` of ``pods`` (numbered over all senders) sends window ``w`` at
``start + w * window_s + i * spread``, the pods' sends spread over 80% of the window as unaligned
sidecars spread them. A pod's window goes out only once its previous window is answered (a sidecar
sends its queue in order; the collector refuses a window older than one it took). Latency is from
when a request could go (due, or its pod's previous window answered; a wait for a free connection
included) to the end of its answer; ``lag`` is how late the sender took a request after its due time
(a sender short of CPU shows there, not as collector latency).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import multiprocessing
import time

from rankwatch import protocol

SPREAD = 0.8
"""Share of the window over which the pods' sends are spread."""


@dataclasses.dataclass
class SenderReport:
    """What one sender process saw, sent back to the bench at the end."""

    latencies: list[float]
    statuses: dict[int, int]
    window_ends: list[float]
    """Per window, the monotonic time its last answer arrived (0 when it sent nothing in that window)."""
    lag_max: float
    held: int
    """Windows that waited for their pod's previous window to be answered before they were sent."""
    cpu_seconds: float
    """The sender process's own CPU (user + system) from its first write to its last answer."""


def request_bytes(port: int, namespace: str, job: str, token: str, body: bytes) -> bytes:
    """One POST of a window summary as a sidecar's shipper sends it (Content-Type, gzip, bearer token)."""
    head = (
        f"POST {protocol.summaries_path(namespace, job)} HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{port}\r\n"
        f"Authorization: {protocol.bearer(token)}\r\n"
        f"Content-Type: {protocol.CONTENT_TYPE}\r\n"
        f"Content-Encoding: {protocol.CONTENT_ENCODING}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _Connection(asyncio.Protocol):
    """One keep-alive connection with at most one request in flight; answers are read just enough to
    know the status and where the answer ends (Content-Length)."""

    def __init__(self, sender: _Sender) -> None:
        self.sender = sender
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.started = 0.0
        self.pod = self.window = -1
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes, pod: int, window: int, started: float) -> None:
        self.busy, self.pod, self.window, self.started = True, pod, window, started
        assert self.transport is not None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buffer[:end]).lower()
        length = _content_length(head)
        if len(self.buffer) < end + 4 + length:
            return
        status = int(head[9:12])
        del self.buffer[: end + 4 + length]
        self.busy = False
        self.sender.answered(self, status, closing=b"\r\nconnection: close" in head)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.busy:
            self.busy = False
            self.sender.answered(self, 0, closing=True)
        self.sender.lost(self)


def _content_length(head: bytes) -> int:
    """The Content-Length of a lower-cased answer head (0 when it has none)."""
    at = head.find(b"\r\ncontent-length:")
    if at < 0:
        return 0
    end = head.find(b"\r\n", at + 2)
    return int(head[at + 17 : end if end >= 0 else len(head)])


class _Sender:
    """The requests of one sender process and the connections they go over."""

    def __init__(self, port: int, windows: list[list[tuple[int, int, bytes]]], window_s: float, pods: int) -> None:
        self.port, self.windows, self.window_s = port, windows, window_s
        self.spread = window_s * SPREAD / pods
        self.idle: collections.deque[_Connection] = collections.deque()
        self.waiting: collections.deque[tuple[bytes, int, int, float]] = collections.deque()
        """Requests due while every connection was busy: (request, pod, window, since when)."""
        self.queued: dict[int, collections.deque[tuple[bytes, int]]] = {}
        """Per pod with a window in flight, its later windows (request, window): a sidecar sends its
        windows one after the other, so none arrives after a newer one (the collector refuses that)."""
        self.held = 0
        self.open = 0
        self.latencies: list[float] = []
        self.statuses: dict[int, int] = {}
        self.window_ends = [0.0] * len(windows)
        self.outstanding = 0
        self.lag_max = 0.0
        self.done_sending = False
        self.done = asyncio.Event()

    async def connect(self, count: int) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(count):
            _, connection = await loop.create_connection(lambda: _Connection(self), "127.0.0.1", self.port)
            self.idle.append(connection)
            self.open += 1

    def lost(self, connection: _Connection) -> None:
        self.open -= 1
        if connection in self.idle:
            self.idle.remove(connection)
        asyncio.get_running_loop().create_task(self._replace())

    async def _replace(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, connection = await loop.create_connection(lambda: _Connection(self), "127.0.0.1", self.port)
        except OSError:
            return
        self.open += 1
        self._free(connection)

    def answered(self, connection: _Connection, status: int, closing: bool) -> None:
        now = time.monotonic()
        pod, window = connection.pod, connection.window
        self.latencies.append(now - connection.started)
        self.statuses[status] = self.statuses.get(status, 0) + 1
        self.window_ends[window] = max(self.window_ends[window], now)
        self.outstanding -= 1
        later = self.queued[pod]
        if closing and connection.transport is not None:
            connection.transport.close()  # connection_lost replaces it
        elif not closing:
            self._free(connection)
        if later:
            self._write(*later.popleft(), pod)
        else:
            del self.queued[pod]
        if self.outstanding == 0 and self.done_sending:
            self.done.set()

    def _free(self, connection: _Connection) -> None:
        if self.waiting:
            connection.send(*self.waiting.popleft())
        else:
            self.idle.append(connection)

    def _dispatch(self, request: bytes, pod: int, window: int) -> None:
        self.outstanding += 1
        later = self.queued.get(pod)
        if later is not None:  # its previous window is still unanswered
            later.append((request, window))
            self.held += 1
            return
        self.queued[pod] = collections.deque()
        self._write(request, window, pod)

    def _write(self, request: bytes, window: int, pod: int) -> None:
        if self.idle:
            self.idle.popleft().send(request, pod, window, time.monotonic())
        else:  # its latency counts from now: a collector slow to answer keeps the connections busy
            self.waiting.append((request, pod, window, time.monotonic()))

    async def run(self, start: float, drain_s: float) -> None:
        for window, requests in enumerate(self.windows):
            base = start + window * self.window_s
            for position, pod, request in requests:
                due = base + position * self.spread
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                self.lag_max = max(self.lag_max, time.monotonic() - due)
                self._dispatch(request, pod, window)
        self.done_sending = True
        if self.outstanding:
            try:
                await asyncio.wait_for(self.done.wait(), drain_s)
            except TimeoutError:
                self.statuses[0] = self.statuses.get(0, 0) + self.outstanding  # never answered


def sender_main(
    port: int,
    windows: list[list[tuple[int, int, bytes]]],
    window_s: float,
    pods: int,
    connections: int,
    ready: multiprocessing.Queue,
    start: multiprocessing.Queue,
    reports: multiprocessing.Queue,
) -> None:
    """One sender process: ``windows`` holds, per window, (position among all pods, pod number, request
    bytes) of its pods in send order. Connects, says ready, waits for the common start time, sends, reports."""

    async def main() -> SenderReport:
        sender = _Sender(port, windows, window_s, pods)
        await sender.connect(connections)
        ready.put(True)
        at = await asyncio.get_running_loop().run_in_executor(None, start.get)
        cpu = time.process_time()
        await sender.run(at, drain_s=60.0)
        return SenderReport(sender.latencies, sender.statuses, sender.window_ends, sender.lag_max, sender.held,
                            time.process_time() - cpu)  # fmt: skip

    reports.put(asyncio.run(main()))
