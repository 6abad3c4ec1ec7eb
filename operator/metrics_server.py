"""``/metrics`` on a port of its own (``RANKWATCH_METRICS_LISTEN``), apart from the collector's.

The collector's port must be open to every job's sidecars; /metrics names every job, its namespace
and its health. On its own port, the NetworkPolicy admits Prometheus there and the sidecars only to
the collector (see the chart's networkpolicy.yaml). Without the setting /metrics stays on the
collector's port (development, the tests' in-process operator).
"""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

log = logging.getLogger(__name__)


async def metrics(_: web.Request) -> web.Response:
    """The process's registry in Prometheus' text format."""
    return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})


class MetricsServer:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self._runner = web.AppRunner(app, access_log=None)

    async def start(self) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]
        log.info("/metrics on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        await self._runner.cleanup()
