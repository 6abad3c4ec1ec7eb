"""The sidecar's HTTP endpoints: /dump and /evidence behind the job's bearer token, /metrics and /healthz open.

/metrics is open as every exporter's is (the cluster's Prometheus scrapes the sidecars of every job
with one scrape config and cannot hold each job's token); it carries counts and wait histograms per
rank and operation, no trace records. Tokens are compared in constant time (``hmac.compare_digest``).
Without a token configured /dump and /evidence answer 401: the sidecar never serves raw traces to
anyone who asks.
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
from rankwatch.sidecar.python_profile import Profiler, ProfilerBusy, RankProfile
from rankwatch.sidecar.ring_tail import RingTail

MAX_DUMP_LIMIT = 1 << 20
OPEN_PATHS = (protocol.HEALTH_PATH, protocol.METRICS_PATH)


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
    profiler: Profiler | None = None,
) -> web.Application:
    @web.middleware
    async def require_token(request: web.Request, handler):
        if request.path not in OPEN_PATHS and not authorized(request, token()):
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

    async def profile(request: web.Request) -> web.Response:
        if profiler is None:
            raise web.HTTPNotFound(text="this sidecar does not profile (RANKWATCH_PYTHON_STACKS=0)\n")
        seconds = _int_param(request, "seconds", 3, 1, 10)
        try:
            wanted = [int(rank) for rank in request.query.get("ranks", "").split(",") if rank.strip()]
        except ValueError:
            raise web.HTTPBadRequest(
                text=f"ranks={request.query.get('ranks')!r}: expected e.g. ranks=5,4,6\n"
            ) from None
        if not wanted or len(wanted) > 16:
            raise web.HTTPBadRequest(text="ranks: expected 1 to 16 global ranks, e.g. ranks=5,4,6\n")
        pids = {t.header.global_rank: t.header.pid for t in tails() if t.header.global_rank in wanted}
        try:
            found = await asyncio.to_thread(profiler.profile, pids, float(seconds or 3))
        except ProfilerBusy as error:
            raise web.HTTPTooManyRequests(text=f"{error}\n") from None
        ranks = {
            rank: found.get(rank) or RankProfile(problem=f"no live ring of rank {rank} in this pod") for rank in wanted
        }
        body = {"seconds": seconds, "ranks": {str(rank): profile.to_json() for rank, profile in ranks.items()}}
        return web.json_response(body)

    app = web.Application(middlewares=[require_token], client_max_size=4096)
    app.router.add_get(protocol.HEALTH_PATH, healthz)
    app.router.add_get(protocol.METRICS_PATH, metrics)
    app.router.add_get(protocol.DUMP_PATH, dump_records)
    app.router.add_get(protocol.EVIDENCE_PATH, evidence)
    app.router.add_get(protocol.PROFILE_PATH, profile)
    return app
