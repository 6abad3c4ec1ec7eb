"""The operator's probes, served from start-up on every replica (``RANKWATCH_PROBE_LISTEN``).

``/healthz``: the process and its event loop answer (liveness: a standby is healthy too).
``/readyz``: 200 only on the leader once its collector serves; 503 with the reason otherwise. The
chart's readiness probe uses it, so the Services (collector, intake, metrics) route to the leader
alone: sidecars' summaries never reach a replica that would not examine them.
"""

from __future__ import annotations

import logging

from aiohttp import web

log = logging.getLogger(__name__)


class Readiness:
    """Why this replica is (not) ready; set by the start-up sequence and the leader election."""

    def __init__(self) -> None:
        self.reason = "starting"
        self.ready = False

    def set(self, ready: bool, reason: str) -> None:
        if (ready, reason) != (self.ready, self.reason):
            log.info("readiness: %s (%s)", "ready" if ready else "not ready", reason)
        self.ready, self.reason = ready, reason


class ProbeServer:
    def __init__(self, host: str, port: int, readiness: Readiness) -> None:
        self.host, self.port, self.readiness = host, port, readiness
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        self._runner = web.AppRunner(app, access_log=None)

    async def start(self) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]
        log.info("probes on %s:%d (/healthz, /readyz)", self.host, self.port)

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, _: web.Request) -> web.Response:
        status = 200 if self.readiness.ready else 503
        return web.Response(status=status, text=f"{self.readiness.reason}\n")
