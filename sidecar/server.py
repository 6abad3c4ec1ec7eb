"""The sidecar's HTTP endpoints: /metrics, /dump and /evidence behind the job's bearer token, /healthz open.

Tokens are compared in constant time (``hmac.compare_digest``). Without a token configured every
authenticated endpoint answers 401: the sidecar never serves raw traces to anyone who asks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from rankwatch import protocol
from rankwatch.sidecar import dump
from rankwatch.sidecar.evidence import evidence_tar
from rankwatch.sidecar.ring_tail import RingTail

MAX_DUMP_LIMIT = 1 << 20


def authorized(request: web.Request, token: str | None) -> bool:
    given = protocol.token_of(request.headers.get("Authorization"))
    return bool(token and given and hmac.compare_digest(given.encode(), token.encode()))


def _int_param(request: web.Request, name: str, default: int | None, low: int, high: int) -> int | None:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name}={raw!r}: expected an integer\n") from None
    if not low <= value <= high:
        raise web.HTTPBadRequest(text=f"{name}={value}: expected {low}..{high}\n")
    return value


def build_app(
    registry: CollectorRegistry,
    tails: Callable[[], list[RingTail]],
    token: Callable[[], str | None],
    trace_dir: Path | None = None,
) -> web.Application:
    @web.middleware
    async def require_token(request: web.Request, handler):
        if request.path != protocol.HEALTH_PATH and not authorized(request, token()):
            raise web.HTTPUnauthorized(
                text="a bearer token is required (the job's rankwatch token)\n",
                headers={"WWW-Authenticate": 'Bearer realm="rankwatch-sidecar"'},
            )
        return await handler(request)

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def dump_records(request: web.Request) -> web.Response:
        since = _int_param(request, "since", 0, 0, 2**63 - 1)
        limit = _int_param(request, "limit", protocol.DUMP_DEFAULT_LIMIT, 1, MAX_DUMP_LIMIT)
        rank = _int_param(request, "rank", None, -1, 2**31 - 1)
        chosen = [t for t in tails() if rank is None or t.header.global_rank == rank]
        # copies are taken here, on the loop (the poll loop may close a ring); encoding runs in a thread
        selected = [(tail, *dump.select(tail, since, limit)) for tail in sorted(chosen, key=lambda t: t.name)]
        if "application/json" in request.headers.get("Accept", ""):
            rings = [dump.records_json(tail, records, claims) for tail, records, claims in selected]
            body = await asyncio.to_thread(lambda: json.dumps({"schema": protocol.SCHEMA_VERSION, "rings": rings}))
            return web.Response(text=body, content_type="application/json")
        images = [dump.ring_image(tail, records) for tail, records, _ in selected]
        ranges = ",".join(
            f"{tail.name}={int(claims[0]) if len(claims) else since}-{int(claims[-1]) + 1 if len(claims) else since}"
            for tail, _, claims in selected
        )
        return web.Response(
            body=b"".join(images),
            content_type="application/octet-stream",
            headers={"X-Rankwatch-Dump-Ranges": ranges} if ranges else None,
        )

    async def evidence(_: web.Request) -> web.Response:
        if trace_dir is None:
            raise web.HTTPNotFound(text="this sidecar serves no trace directory\n")
        body = await asyncio.to_thread(evidence_tar, trace_dir)
        return web.Response(body=body, content_type="application/x-tar")

    app = web.Application(middlewares=[require_token], client_max_size=4096)
    app.router.add_get(protocol.HEALTH_PATH, healthz)
    app.router.add_get(protocol.METRICS_PATH, metrics)
    app.router.add_get(protocol.DUMP_PATH, dump_records)
    app.router.add_get(protocol.EVIDENCE_PATH, evidence)
    return app
