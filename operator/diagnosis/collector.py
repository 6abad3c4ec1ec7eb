"""The collector: the operator's HTTP side of the sidecar protocol (``rankwatch.protocol``).

Runs on the operator's event loop (aiohttp). Each request is checked in order of cost: rate limit
(per job), bearer token (the job's Secret, constant-time compare), size, gzip, schema, that the
message speaks of the job in its path; then it is deduplicated on (pod, start_ns, window) (delivery
is at least once) and folded into the job's in-memory state. Answers follow the protocol: 2xx taken,
400/404/413/422 refused for good, 401/429/503 worth retrying; every refusal is JSON
``{"error": "..."}`` naming what to fix. Nothing here blocks: the Secret read runs in a thread.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import kubernetes
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from kubernetes.client.exceptions import ApiException
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from rankwatch import protocol
from rankwatch.operator import api
from rankwatch.operator.diagnosis import metrics
from rankwatch.operator.diagnosis.job_state import JobStore

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
        try:
            secret = kubernetes.client.CoreV1Api(self.kube).read_namespaced_secret(
                api.token_secret_name(name), namespace
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise TokenUnavailable(
                f"reading Secret {namespace}/{api.token_secret_name(name)}: HTTP {error.status}"
            ) from None
        except Exception as error:  # connection trouble: retry later, never a 500 with a traceback
            raise TokenUnavailable(f"reading Secret {namespace}/{api.token_secret_name(name)}: {error}") from error
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


@dataclass(frozen=True)
class CollectorSettings:
    host: str = "0.0.0.0"
    port: int = 8080
    rate_per_job: float = 200.0
    """Messages per second per job: a 1,000-pod job with 5 s windows sends 200."""
    burst_per_job: float = 2000.0


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


class Collector:
    """Builds the aiohttp app; ``on_stall(namespace, name)`` is called when a stall report arrives."""

    def __init__(
        self,
        store: JobStore,
        tokens: TokenLookup,
        settings: CollectorSettings,
        on_stall: Callable[[str, str], None] | None = None,
    ) -> None:
        self.store = store
        self.tokens = tokens
        self.settings = settings
        self.limiter = RateLimiter(settings.rate_per_job, settings.burst_per_job)
        self.on_stall = on_stall
        self.app = web.Application(client_max_size=protocol.MAX_DECODED_BYTES)
        self.app.router.add_post(protocol.SUMMARIES_PATH, self._summaries)
        self.app.router.add_post(protocol.STALLS_PATH, self._stalls)
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_get("/healthz", self._healthz)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        log.info("collector listening on %s:%d", self.settings.host, self.port)

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()
            self._runner = None

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _summaries(self, request: web.Request) -> web.Response:
        return await self._take(request, "summary")

    async def _stalls(self, request: web.Request) -> web.Response:
        return await self._take(request, "stall")

    async def _take(self, request: web.Request, kind: str) -> web.Response:
        response = await self._handle(request, kind)
        result = {
            200: "accepted",
            202: "accepted",
            208: "duplicate",
            401: "unauthorized",
            404: "unknown_job",
            413: "too_large",
            400: "invalid",
            422: "invalid",
            429: "rate_limited",
        }.get(response.status, "error")
        metrics.COLLECTOR_MESSAGES.labels(kind, result).inc()
        return response

    async def _handle(self, request: web.Request, kind: str) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        job = f"TrainingJob {namespace}/{name}"
        wait = self.limiter.take((namespace, name))
        if wait:
            return _error(429, f"{job}: over {self.settings.rate_per_job:.0f} messages/s", **{"Retry-After": "1"})
        given = protocol.token_of(request.headers.get("Authorization"))
        if given is None:
            return _error(401, "send Authorization: Bearer <the job's rankwatch token>")
        try:
            token = await self.tokens(namespace, name)
            if token is not None and not hmac.compare_digest(given.encode(), token.encode()):
                token = await self.tokens(namespace, name, stale=True)
        except TokenUnavailable as error:
            return _error(503, f"{job}: token not readable now ({error}); retry", **{"Retry-After": "5"})
        if token is None:
            return _error(404, f"{job}: no such job with tracing enabled (no Secret {api.token_secret_name(name)})")
        if not hmac.compare_digest(given.encode(), token.encode()):
            return _error(401, f"{job}: the bearer token is not this job's (Secret {api.token_secret_name(name)})")
        if request.content_length is not None and request.content_length > protocol.MAX_BODY_BYTES:
            return _error(413, f"body of {request.content_length} bytes; the limit is {protocol.MAX_BODY_BYTES}")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"body decompresses to more than {protocol.MAX_DECODED_BYTES} bytes")
        except RequestPayloadError as error:  # aiohttp decompresses gzip itself
            return _error(400, f"body could not be read: {error}")
        try:
            body = protocol.decode_body(raw, request.headers.get("Content-Encoding"))
        except protocol.ProtocolError as error:
            status = 413 if "over the limit" in str(error) or "more than" in str(error) else 400
            return _error(status, str(error))
        try:
            message = protocol.parse_summary(body) if kind == "summary" else protocol.parse_stall(body)
        except protocol.ProtocolError as error:
            return _error(422, str(error))
        if (message.namespace, message.job) != (namespace, name):
            return _error(422, f"the message is about {message.namespace}/{message.job}, posted to {namespace}/{name}")
        state = self.store.get(namespace, name)
        if isinstance(message, protocol.WindowSummary):
            if state.duplicate((message.pod, message.start_ns, message.window)):
                return web.json_response({"duplicate": True}, status=208)
            state.add_summary(message)
            metrics.COLLECTOR_RANK_WINDOWS.inc(len(message.ranks))
        else:
            if state.duplicate((message.pod, message.detected_ns, -1)):
                return web.json_response({"duplicate": True}, status=208)
            state.add_stall(message)
            log.warning("%s: stall reported by %s: %s", job, message.pod, message.summary)
            if self.on_stall:
                self.on_stall(namespace, name)
        return web.json_response({"accepted": True}, status=202)
