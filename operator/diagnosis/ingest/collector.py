"""The collector: the operator's HTTP side of the sidecar protocol (``rankwatch.protocol``).

Runs on the operator's event loop (aiohttp). Each request is checked so that nothing is kept for a
client before it has proven to be a job's sidecar: a bearer token at all, a job rankwatch follows
(else the same 401 as a wrong token, so an outsider cannot tell which jobs exist), the job's token
(its Secret, constant-time compare); then the job's rate limit, the body (size as sent, read within
a timeout, its bytes as sent counted against a budget shared by all requests in flight), gzip
(inflated where it is parsed, to at most ``protocol.MAX_DECODED_BYTES``), schema (NaN and infinities
refused), that the message speaks of the job in its path and of ranks in its world size; then it is
deduplicated on (pod, start_ns, window) (delivery is at least once), a window older than the pod's
newest is refused as replayed (409), and the rest is folded into the job's bounded in-memory state.
Answers follow the protocol: 2xx taken, 400/404/409/413/422 refused for good, 401/408/429/503 worth
retrying; every refusal is JSON ``{"error": "..."}`` naming what to fix. Nothing here blocks: the
Secret read runs in a thread, the bodies' inflation and checks in worker processes
(``message_parser``), the event loop keeps HTTP and the job states.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import time
from collections.abc import Callable
from typing import Protocol

import kubernetes
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from kubernetes.client.exceptions import ApiException
from prometheus_client import Counter

from rankwatch import http_logging, protocol
from rankwatch.operator import api, metrics_server
from rankwatch.operator.config import CollectorSettings
from rankwatch.operator.diagnosis.ingest.job_state import JobStore, StateLimits, SummaryDigest
from rankwatch.operator.diagnosis.ingest.message_parser import MessageParser, Refusal
from rankwatch.operator.diagnosis.metrics import DiagnosisMetrics

log = logging.getLogger(__name__)


class TokenLookup(Protocol):
    """(namespace, job) -> the job's token, None when the job has none (no such job / tracing off);
    ``stale=True``: the cached one did not match, re-read it if allowed (token rotation)."""

    async def __call__(self, namespace: str, name: str, stale: bool = False) -> str | None: ...


class TokenUnavailable(RuntimeError):
    """The token could not be read now (API server trouble): the sidecar should retry."""


class SecretTokens:
    """Job tokens read from the jobs' Secrets, cached; a mismatch re-reads (rotation) at most every
    ``refresh_s`` per job, so a stream of bad tokens cannot turn into a stream of API reads."""

    def __init__(self, kube: kubernetes.client.ApiClient, refresh_s: float = 10.0) -> None:
        self.kube = kube
        self.refresh_s = refresh_s
        self._cache: dict[tuple[str, str], tuple[str | None, float]] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    async def __call__(self, namespace: str, name: str, stale: bool = False) -> str | None:
        key = (namespace, name)
        cached = self._cache.get(key)
        if cached and not (stale and time.monotonic() - cached[1] >= self.refresh_s):
            return cached[0]
        async with self._locks.setdefault(key, asyncio.Lock()):
            cached = self._cache.get(key)
            if cached and not (stale and time.monotonic() - cached[1] >= self.refresh_s):
                return cached[0]
            token = await asyncio.to_thread(self._read, namespace, name)
            self._cache[key] = (token, time.monotonic())
            return token

    def forget(self, namespace: str, name: str) -> None:
        self._cache.pop((namespace, name), None)
        self._locks.pop((namespace, name), None)

    def _read(self, namespace: str, name: str) -> str | None:
        secret_name = token_secret_of(name)
        if secret_name is None:
            return None
        try:
            secret = kubernetes.client.CoreV1Api(self.kube).read_namespaced_secret(secret_name, namespace)
        except ApiException as error:
            if error.status == 404:
                return None
            raise TokenUnavailable(f"reading Secret {namespace}/{secret_name}: HTTP {error.status}") from None
        except Exception as error:  # connection trouble: retry later, never a 500 with a traceback
            raise TokenUnavailable(f"reading Secret {namespace}/{secret_name}: {error}") from error
        return secret_token(secret)


def token_secret_of(name: str) -> str | None:
    """The token Secret of the job the collector knows as ``name``: a TrainingJob's, or a group's of
    another kind (``<Kind>:<name>``); None for a kind rankwatch does not know."""
    split = api.split_collector_name(name)
    return api.token_secret_name(name) if split is None else api.group_token_secret_name(*split)


def secret_token(secret: kubernetes.client.V1Secret) -> str | None:
    """The sidecar token a job's Secret holds (None when it holds none)."""
    value = (secret.data or {}).get(api.TOKEN_KEY)
    return base64.b64decode(value).decode().strip() if value else None


class RateLimiter:
    """A token bucket per job: ``rate`` messages per second, bursts of ``burst``."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self._clock = rate, burst, clock
        self._buckets: dict[tuple[str, str], tuple[float, float]] = {}

    def take(self, key: tuple[str, str]) -> float:
        """0 when allowed; else the seconds until a message would be."""
        now = self._clock()
        level, at = self._buckets.get(key, (self.burst, now))
        level = min(self.burst, level + (now - at) * self.rate)
        if level >= 1:
            self._buckets[key] = (level - 1, now)
            return 0.0
        self._buckets[key] = (level, now)
        return (1 - level) / self.rate


JobLimits = Callable[[str, str], StateLimits | None]
"""(namespace, name) -> the job's state limits when rankwatch follows that job, else None."""

LINGER_S = 2.0
ACCEPTED = b'{"accepted": true}'
"""The answer to a message taken (made once: 1,600 a second at 64,000 ranks)."""


RESULTS = {
    200: "accepted",
    202: "accepted",
    208: "duplicate",
    401: "unauthorized",
    404: "unknown_job",
    408: "too_slow",
    409: "replayed",
    413: "too_large",
    400: "invalid",
    422: "invalid",
    429: "rate_limited",
    503: "busy",
}
"""The result label (rankwatch_collector_messages_total) of each status the collector answers; others: error."""


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


def _unauthorized(job: str) -> web.Response:
    """One answer for "no such job", "no token" and "wrong token": an outsider cannot tell which jobs exist.
    (Made when refusing, not ahead of every request: a JSON response costs ~6 us to build.)"""
    return _error(401, f"{job}: send Authorization: Bearer <the job's rankwatch token>")


class ByteBudget:
    """Bytes that requests in flight may hold together; taken chunk by chunk as bodies arrive."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, count: int) -> bool:
        if self.held + count > self.limit:
            return False
        self.held += count
        return True

    def give(self, count: int) -> None:
        self.held -= count


class _Refused(Exception):
    def __init__(self, response: web.Response) -> None:
        self.response = response


class Collector:
    """Builds the aiohttp app; ``on_stall(namespace, name)`` is called when a stall report arrives.
    ``jobs`` says which jobs exist (and how much state each may hold): messages for any other job are
    refused before anything is kept or looked up."""

    def __init__(
        self,
        store: JobStore,
        tokens: TokenLookup,
        settings: CollectorSettings,
        on_stall: Callable[[str, str], None] | None = None,
        *,
        jobs: JobLimits,
        metrics: DiagnosisMetrics | None = None,
    ) -> None:
        self.metrics = metrics or DiagnosisMetrics.uncounted()
        self.store = store
        self.tokens = tokens
        self.settings = settings
        self.jobs = jobs
        self.limiter = RateLimiter(settings.rate_per_job, settings.burst_per_job)
        self.bodies = ByteBudget(settings.inflight_body_bytes)
        self.on_stall = on_stall
        self.parser = MessageParser(settings.parse_workers)
        self._counters: dict[tuple[str, int], Counter] = {}
        self.app = web.Application(client_max_size=protocol.MAX_BODY_BYTES)
        self.app.router.add_post(protocol.SUMMARIES_PATH, self._summaries)
        self.app.router.add_post(protocol.STALLS_PATH, self._stalls)
        if settings.serves_metrics:
            self.app.router.add_get("/metrics", metrics_server.metrics)
        self.app.router.add_get("/healthz", self._healthz)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> None:
        http_logging.quiet_client_errors()
        await self.parser.start()
        # lingering_time: after refusing a body, read and drop the rest of it for at most this long.
        # auto_decompress off: bodies reach the handler as sent (gzip) and are inflated in the parsing
        # worker, bounded there, instead of on the event loop (about a tenth of its time at 64,000 ranks).
        self._runner = web.AppRunner(
            self.app,
            access_log=None,
            keepalive_timeout=self.settings.idle_timeout_s,
            lingering_time=LINGER_S,
            auto_decompress=False,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        log.info("collector listening on %s:%d", self.settings.host, self.port)

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()
            self._runner = None
        self.parser.close()

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _summaries(self, request: web.Request) -> web.Response:
        return await self._take(request, "summary")

    async def _stalls(self, request: web.Request) -> web.Response:
        return await self._take(request, "stall")

    async def _take(self, request: web.Request, kind: str) -> web.Response:
        """One message, answered and counted by result; a bug on some input answers a short JSON 500
        (logged here with its traceback), never a page with the traceback or a dropped connection.
        (Here rather than in a middleware: aiohttp runs middlewares as two more coroutines per request.)"""
        try:
            response = await self._handle(request, kind)
        except web.HTTPException:
            raise
        except Exception:
            log.exception("collector: %s %s failed", request.method, request.path)
            response = _error(500, "internal error in the collector (logged by the operator); retry later")
        self._counter(kind, response.status).inc()
        return response

    def _counter(self, kind: str, status: int) -> Counter:
        """The messages counter of (kind, the result an answer's status means), looked up once: prometheus'
        ``labels()`` takes a lock and builds its key on every call (1,600 answers a second at 64,000 ranks)."""
        counter = self._counters.get((kind, status))
        if counter is None:
            result = RESULTS.get(status, "error")
            counter = self._counters[(kind, status)] = self.metrics.collector_messages.labels(kind, result)
        return counter

    async def _handle(self, request: web.Request, kind: str) -> web.Response:
        """Checks in an order that keeps nothing for a stranger: a token at all, a job rankwatch follows,
        the job's token; only then the job's rate, the body and the message."""
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        split = api.split_collector_name(name)
        job = f"{split[0]} {namespace}/{split[1]}" if split else f"TrainingJob {namespace}/{name}"
        given = protocol.token_of(request.headers.get("Authorization"))
        if given is None:
            return _unauthorized(job)
        limits = self.jobs(namespace, name)
        if limits is None:
            return _unauthorized(job)
        try:
            token = await self.tokens(namespace, name)
            if token is not None and not hmac.compare_digest(given.encode(), token.encode()):
                token = await self.tokens(namespace, name, stale=True)
        except TokenUnavailable as error:
            return _error(503, f"{job}: token not readable now ({error}); retry", **{"Retry-After": "5"})
        if token is None or not hmac.compare_digest(given.encode(), token.encode()):
            return _unauthorized(job)
        if self.limiter.take((namespace, name)):
            return _error(429, f"{job}: over {self.settings.rate_per_job:.0f} messages/s", **{"Retry-After": "1"})
        if request.content_length is not None and request.content_length > protocol.MAX_BODY_BYTES:
            return _error(413, f"body of {request.content_length} bytes; the limit is {protocol.MAX_BODY_BYTES}")
        try:
            raw = await self._read_body(request)
        except _Refused as refused:
            return refused.response
        held = len(raw)
        try:
            message = await self.parser.parse(raw, request.headers.get("Content-Encoding"), kind)
        finally:
            self.bodies.give(held)
        if isinstance(message, Refusal):
            extra = {"Retry-After": "1"} if message.status == 503 else {}
            return _error(message.status, message.error, **extra)
        return self._keep(namespace, name, job, limits, message)

    async def _read_body(self, request: web.Request) -> bytes:
        """The body as sent (gzip'd, inflated later by the parser), its bytes taken from the budget (the
        caller gives them back)."""
        content = request.content
        if content.is_eof():  # it came whole with its head, as a summary mostly does: nothing to wait for
            body = content.read_nowait()
            self._hold(0, len(body))
            return body
        chunks: list[bytes] = []
        held = 0
        try:
            async with asyncio.timeout(self.settings.body_timeout_s):
                async for chunk in content.iter_any():
                    self._hold(held, len(chunk))
                    held += len(chunk)
                    chunks.append(chunk)
        except TimeoutError:
            self.bodies.give(held)
            too_slow = _error(408, f"body not received within {self.settings.body_timeout_s:g} s")
            too_slow.force_close()  # the rest of a slow body is not waited for on this connection either
            raise _Refused(too_slow) from None
        except RequestPayloadError as error:  # a broken chunked transfer encoding
            self.bodies.give(held)
            raise _Refused(_error(400, f"body could not be read: {error}")) from None
        except _Refused:
            self.bodies.give(held)
            raise
        return b"".join(chunks)

    def _hold(self, held: int, count: int) -> None:
        """Take ``count`` more bytes of a body of which ``held`` are held, or refuse it: over the size
        limit (413), or over the budget of bodies in flight (503)."""
        if held + count > protocol.MAX_BODY_BYTES:
            raise _Refused(_error(413, f"body over the limit of {protocol.MAX_BODY_BYTES} bytes (as sent)"))
        if not self.bodies.take(count):
            raise _Refused(_error(503, "the collector is busy reading other bodies; retry", **{"Retry-After": "1"}))

    def _keep(
        self, namespace: str, name: str, job: str, limits: StateLimits, message: SummaryDigest | protocol.StallReport
    ) -> web.Response:
        if (message.namespace, message.job) != (namespace, name):
            return _error(422, f"the message is about {message.namespace}/{message.job}, posted to {namespace}/{name}")
        outside = _ranks_outside(message, limits.ranks)
        if outside is not None:
            last = limits.ranks - 1
            return _error(422, f"{job}: rank {outside} is outside the world size {limits.ranks} (ranks 0..{last})")
        state = self.store.get(namespace, name, limits)
        if isinstance(message, SummaryDigest):
            if state.duplicate((message.pod, message.start_ns, message.window)):
                return web.json_response({"duplicate": True}, status=208)
            newest = state.replayed(message)
            if newest is not None:
                return _error(
                    409,
                    f"{job}: window {message.window} of pod {message.pod} starts at {message.start_ns} ns, before "
                    f"the newest window taken from it ({newest} ns): replayed or sent out of order; not taken",
                )
            state.add_digest(message)
            self.metrics.collector_rank_windows.inc(len(message.ranks))
        else:
            if state.duplicate((message.pod, message.detected_ns, -1)):
                return web.json_response({"duplicate": True}, status=208)
            state.add_stall(message)
            log.warning("%s: stall reported by %s: %s", job, message.pod, message.summary[:500])
            if self.on_stall:
                self.on_stall(namespace, name)
        return web.Response(body=ACCEPTED, status=202, content_type="application/json")


def _ranks_outside(message: SummaryDigest | protocol.StallReport, world_size: int) -> int | None:
    """The first global rank the message names at or beyond the job's world size, if any."""
    if isinstance(message, SummaryDigest):
        ranks = [window[0] for window in message.ranks]  # a RankDigest starts with its global rank
    else:
        ranks = [position.global_rank for position in message.positions] + list(message.stalled_ranks)
    return next((rank for rank in ranks if rank >= world_size), None)
