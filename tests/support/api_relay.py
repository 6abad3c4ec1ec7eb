"""A relay between the operator and the local API server that sees each request, for failure tests.

It terminates TLS with the API server's own serving certificate (the operator's kubeconfig needs only
a new address) and opens TLS to the API server with the operator's client certificate, or passes its
bearer token on in the request heads (the API server sees the same identity). So it reads each
request's method and path, and a test can act at the very moment a given request is made, before the
API server sees it: restart the API server or etcd, or cut the link; or answer it with an error of its
own (the API server never sees it), or pass it on and lose its answer (the API server applies it, the
client never learns). Cutting is a network partition:
nothing is refused or reset, bytes are held; a lossy cut also loses the connections open during it
(they never carry another byte and are never closed, as after a partition that outlived the peers'
connection state), so only new connections work after it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from urllib.parse import urlsplit

import yaml

Action = Callable[[], None]


@dataclass
class _Trigger:
    method: str
    path: re.Pattern[str]
    body: re.Pattern[bytes] | None
    action: Action
    status: int | None = None
    """Answer the request with this HTTP status instead of passing it on."""
    lose_answer: bool = False
    """Pass the request on, then lose its connection (its answer never arrives)."""
    claimed: bool = False
    fired: threading.Event = field(default_factory=threading.Event)

    def matches(self, method: str, path: str, body: bytes) -> bool:
        return (
            not self.claimed
            and method == self.method
            and bool(self.path.search(path))
            and (self.body is None or bool(self.body.search(body)))
        )

    def fire(self) -> None:
        """On a thread of its own: it finishes even if the request that fired it is dropped meanwhile."""
        self.action()
        self.fired.set()


@dataclass(eq=False)
class _Connection:
    lost: bool = False
    serving: asyncio.Task | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)


class ApiRelay:
    def __init__(self, kubeconfig: Path, pki: Path, workdir: Path) -> None:
        config = yaml.safe_load(kubeconfig.read_text())
        self._config = config
        server = urlsplit(config["clusters"][0]["cluster"]["server"])
        self.upstream = (server.hostname or "127.0.0.1", server.port or 443)
        user = config["users"][0]["user"]
        self._upstream_tls = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        if "client-certificate-data" in user:  # a bearer token needs nothing: the request heads carry it
            workdir.mkdir(parents=True, exist_ok=True)
            cert, key = workdir / "relay-client.crt", workdir / "relay-client.key"
            cert.write_bytes(base64.b64decode(user["client-certificate-data"]))
            key.write_bytes(base64.b64decode(user["client-key-data"]))
            key.chmod(0o600)
            self._upstream_tls.load_cert_chain(str(cert), str(key))
        self._upstream_tls.set_alpn_protocols(["http/1.1"])
        self._serving_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._serving_tls.load_cert_chain(str(pki / "apiserver.crt"), str(pki / "apiserver.key"))
        self._serving_tls.set_alpn_protocols(["http/1.1"])
        self.requests: list[tuple[str, str]] = []
        """(method, path) of every request carried or held, in order."""
        self._triggers: list[_Trigger] = []
        self._connections: set[_Connection] = set()
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True, name="api-relay").start()
        self._linked: asyncio.Event = self._run(self._make_event())
        self._lossy = False
        self._server = self._run(self._listen())
        self.port: int = self._server.sockets[0].getsockname()[1]

    # -- what tests call -------------------------------------------------------------------------------
    def kubeconfig(self, path: Path) -> Path:
        """The operator's kubeconfig, through the relay."""
        config = yaml.safe_load(yaml.safe_dump(self._config))
        config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{self.port}"
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def when(self, method: str, path: str, body: bytes | None, action: Action) -> threading.Event:
        """Run ``action`` (on a thread) when the first request ``method`` on a path matching the regular
        expression ``path`` (and a body matching ``body``, unless None) is made; the request waits until
        it returns, then goes on (or is held if the action cut the link). Returns an Event set once the
        action has run. A request strikes one trigger, the first made: two made for the same request
        strike it and the next one."""
        trigger = _Trigger(method.upper(), re.compile(path), re.compile(body) if body else None, action)
        self._triggers.append(trigger)
        return trigger.fired

    def answer(self, method: str, path: str, body: bytes | None, status: int) -> threading.Event:
        """Answer the first request that matches (as :meth:`when`) with HTTP ``status`` and a Status body,
        without passing it on: the API server never sees it."""
        trigger = _Trigger(method.upper(), re.compile(path), re.compile(body) if body else None, _nothing, status)
        self._triggers.append(trigger)
        return trigger.fired

    def lose_answer(self, method: str, path: str, body: bytes | None) -> threading.Event:
        """Pass the first request that matches (as :meth:`when`) on to the API server, which applies it,
        and lose its connection from then on: the answer never arrives, as after a partition that came
        just after the request."""
        pattern = re.compile(body) if body else None
        trigger = _Trigger(method.upper(), re.compile(path), pattern, _nothing, lose_answer=True)
        self._triggers.append(trigger)
        return trigger.fired

    def cut(self, lossy: bool = False) -> None:
        """Stop carrying bytes; ``lossy``: the connections open now or made until :meth:`heal` are lost."""

        def cut() -> None:
            self._lossy = lossy
            if lossy:
                for connection in self._connections:
                    connection.lost = True
            self._linked.clear()

        self._loop.call_soon_threadsafe(cut)

    def heal(self) -> None:
        def heal() -> None:
            self._lossy = False
            self._linked.set()

        self._loop.call_soon_threadsafe(heal)

    def close(self) -> None:
        self.heal()
        self._run(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)

    # -- the relay -------------------------------------------------------------------------------------
    def _run(self, coroutine):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(30)

    async def _make_event(self) -> asyncio.Event:
        linked = asyncio.Event()
        linked.set()
        return linked

    async def _listen(self) -> asyncio.Server:
        return await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self._serving_tls, limit=1 << 22)

    async def _close(self) -> None:
        self._server.close()
        tasks = [task for connection in self._connections for task in (connection.serving, *connection.tasks) if task]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _carry(self, connection: _Connection) -> None:
        """Wait while the link is cut; forever for a lost connection."""
        while not self._linked.is_set() or connection.lost:
            if connection.lost:
                await asyncio.Event().wait()  # until the relay is closed
            await self._linked.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _Connection(lost=self._lossy and not self._linked.is_set(), serving=asyncio.current_task())
        self._connections.add(connection)
        try:
            await self._carry(connection)
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(
                    *self.upstream, ssl=self._upstream_tls, limit=1 << 22
                )
            except OSError:  # the API server is down: the operator sees its connection dropped
                writer.transport.abort()
                return
            connection.tasks = [
                asyncio.ensure_future(self._requests(reader, upstream_writer, writer, connection)),
                asyncio.ensure_future(self._responses(upstream_reader, writer, connection)),
            ]
            await asyncio.wait(connection.tasks, return_when=asyncio.FIRST_COMPLETED)
            await self._carry(connection)  # a close is held like any byte (a lost connection is never closed)
            for task in connection.tasks:
                task.cancel()
            for end in (writer, upstream_writer):
                end.transport.abort()
        finally:
            self._connections.discard(connection)

    async def _requests(
        self,
        reader: asyncio.StreamReader,
        upstream: asyncio.StreamWriter,
        client: asyncio.StreamWriter,
        connection: _Connection,
    ):
        """Client to API server, one request at a time (heads parsed, bodies by Content-Length)."""
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, OSError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path = head.split(b" ", 2)[:2]
                headers = head.lower()
                length = re.search(rb"\r\ncontent-length:\s*(\d+)", headers)
                if b"transfer-encoding: chunked" in headers:
                    raise AssertionError(f"the relay reads no chunked request bodies: {head[:200]!r}")
                body = await reader.readexactly(int(length.group(1))) if length else b""
                request = (method.decode(), path.decode())
                self.requests.append(request)
                # One trigger per request, the first made: two on the same request strike it and the next.
                trigger = next((t for t in self._triggers if t.matches(*request, body)), None)
                if trigger is not None:
                    trigger.claimed = True
                    await asyncio.to_thread(trigger.fire)
                await self._carry(connection)
                if trigger is not None and trigger.status is not None:
                    client.write(_error_response(trigger.status))
                    await client.drain()
                    continue
                if trigger is not None and trigger.lose_answer:
                    connection.lost = True  # no await before the write: the answer cannot slip through
                upstream.write(head + body)
                await upstream.drain()

    async def _responses(self, upstream: asyncio.StreamReader, writer: asyncio.StreamWriter, connection: _Connection):
        with contextlib.suppress(ConnectionError, OSError):
            while data := await upstream.read(1 << 16):
                await self._carry(connection)
                writer.write(data)
                await writer.drain()


def _nothing() -> None:
    pass


def _error_response(status: int) -> bytes:
    """An HTTP/1.1 answer as the API server words its errors (a Status object)."""
    reason = HTTPStatus(status).phrase
    body = json.dumps(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "message": f"injected by the test relay: {reason}",
            "reason": reason.replace(" ", ""),
            "code": status,
        }
    ).encode()
    head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body
