"""`rankwatch sidecar`: poll the rings, watch for stalls, close windows, serve and ship, on one event loop.

Polling is a few vectorised numpy passes per ring (milliseconds), so it runs on the loop itself;
the only slow step, writing Megatrace logs after a stall, runs in a thread. SIGTERM (and SIGINT)
stop the loop after a last poll, a last window and a bounded wait for the queue to drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import time
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from rankwatch import http_logging
from rankwatch.protocol import StallReport, WindowSummary
from rankwatch.sidecar.config import SidecarConfig, TokenSource
from rankwatch.sidecar.host_load import HostSampler
from rankwatch.sidecar.metrics import LiveRank, LiveState, SidecarMetrics
from rankwatch.sidecar.progress import RankProgress
from rankwatch.sidecar.python_profile import Profiler
from rankwatch.sidecar.python_stacks import StackTaker, py_spy
from rankwatch.sidecar.ring_tail import RingSet, RingTail
from rankwatch.sidecar.server import build_app
from rankwatch.sidecar.shipper import Shipper
from rankwatch.sidecar.stall_watch import StallWatch, WatchedRank, write_megatrace
from rankwatch.sidecar.summary import PodIdentity, WindowBuilder

log = logging.getLogger("rankwatch.sidecar")

STACKS_DEADLINE_S = 10.0
"""A stall report waits at most this long for the ranks' Python stacks, then goes without them."""


class Sidecar:
    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.identity = PodIdentity(
            namespace=config.namespace,
            job=config.job,
            pod=config.pod,
            node=config.node,
            replica_index=config.replica_index,
            expected_ranks=config.nproc_per_node,
        )
        self.token = TokenSource(config.token_file)
        self.rings = RingSet(config.trace_dir)
        self.progress: dict[str, RankProgress] = {}
        self.alive: dict[str, bool] = {}
        self.windows = WindowBuilder(
            self.identity, time.time_ns(), HostSampler(visible=lambda: self.rings.probe.visible)
        )
        self.watch = StallWatch(self.identity, config.trace_dir, config.sensitivity_s)
        self.shipper = (
            Shipper(
                config.collector_url,
                config.namespace,
                config.job,
                self.token,
                queue_size=config.queue_size,
                timeout=config.post_timeout_s,
            )
            if config.collector_url
            else None
        )
        self.metrics = SidecarMetrics(self.live_state)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.metrics)
        self.stall_reports: list[StallReport] = []
        self.summaries = 0
        self._megatrace: set[asyncio.Task] = set()
        self._stacks: set[asyncio.Task] = set()
        self.stack_taker = StackTaker() if config.python_stacks and py_spy() else None
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # -- one step each; synchronous and cheap ------------------------------------------------------
    def poll(self, now_ns: int | None = None) -> StallReport | None:
        """Read every ring once; returns a stall report when a rank newly stalled (already queued)."""
        for ring in self.rings.poll():
            name = ring.tail.name
            progress = self.progress.get(name)
            if progress is None or progress.tail is not ring.tail:
                progress = self.progress[name] = RankProgress(ring.tail)
            entered, finished = progress.update(ring.batch)
            self.windows.add(ring, progress, entered, finished)
            self.metrics.observe(ring, entered, finished)
            if ring.ended:
                del self.progress[name]
                self.alive.pop(name, None)
            else:
                self.alive[name] = ring.alive
        now_ns = time.time_ns() if now_ns is None else now_ns
        watched = [WatchedRank(p, self.alive.get(name, True)) for name, p in self.progress.items()]
        report = self.watch.check(watched, now_ns)
        if report is not None:
            log.warning("stall: %s", report.summary)
            if self.stack_taker is None:
                self._stall_ready(report)
            else:
                self._with_stacks(report)
        return report

    def _stall_ready(self, report: StallReport) -> None:
        self.stall_reports.append(report)
        if self.shipper:
            self.shipper.submit_stall(report)

    def _with_stacks(self, report: StallReport) -> None:
        """Ship ``report`` once the ranks' Python stacks are taken (in a thread, bounded in time)."""
        pids = {p.global_rank: p.pid for p in report.positions if p.alive and p.pid > 0}

        async def take() -> None:
            stacks: dict[int, list[str]] = {}
            try:
                stacks = await asyncio.wait_for(asyncio.to_thread(self.stack_taker.stacks, pids), STACKS_DEADLINE_S)
            except Exception:  # stacks are extra evidence: the report goes without them
                log.exception("taking the ranks' Python stacks failed; the stall report goes without them")
            positions = [dataclasses.replace(p, python_stack=stacks.get(p.global_rank)) for p in report.positions]
            if stacks:
                log.warning("Python stacks of ranks %s taken for the stall report", sorted(stacks))
            self._stall_ready(dataclasses.replace(report, positions=positions))

        task = asyncio.create_task(take())
        self._stacks.add(task)
        task.add_done_callback(self._stacks.discard)

    def close_window(self, now_ns: int | None = None) -> WindowSummary:
        summary = self.windows.close(time.time_ns() if now_ns is None else now_ns)
        self.summaries += 1
        if self.shipper:
            self.shipper.submit_summary(summary)
        else:
            calls = sum(sum(c.calls.values()) for r in summary.ranks for c in r.comms)
            log.info(
                "window %d: %d ranks, %d calls (no collector configured)", summary.window, len(summary.ranks), calls
            )
        return summary

    def newest_rings(self) -> list[RingTail]:
        """The followed rings, one per rank (the newest when a restarted rank has two)."""
        newest: dict[tuple[str, int], RingTail] = {}
        for tail in self.rings.tails.values():
            key = (tail.header.hostname, tail.header.global_rank if tail.header.global_rank >= 0 else -tail.header.pid)
            if key not in newest or tail.header.start_realtime_ns > newest[key].header.start_realtime_ns:
                newest[key] = tail
        return sorted(newest.values(), key=lambda t: t.name)

    def live_state(self) -> LiveState:
        now = time.time_ns()
        ranks = []
        for name, progress in self.progress.items():
            age = progress.oldest_in_flight_age_s(now)
            tail = progress.tail
            if name in self.rings.tails:
                ranks.append(
                    LiveRank(tail.header.global_rank, age if age is not None else progress.silent_s(now), tail.lag())
                )
        stats = self.shipper.stats if self.shipper else None
        return LiveState(
            ranks=ranks,
            rings=len(self.rings.tails),
            unreadable_rings=len(self.rings.problems),
            queued=self.shipper.queued() if self.shipper else 0,
            summaries_sent=stats.summaries_sent if stats else 0,
            summaries_dropped=stats.summaries_dropped if stats else 0,
            stalls_sent=stats.stalls_sent if stats else 0,
            stall_reports=len(self.stall_reports),
            post_failures=stats.failures if stats else 0,
            rejected=stats.rejected if stats else 0,
        )

    # -- the loop ------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.token() is None:
            log.warning(
                "no bearer token (RANKWATCH_TOKEN_FILE / --token-file): /metrics and /dump answer 401, and the "
                "collector will refuse summaries"
            )
        app = build_app(self.registry, lambda: list(self.rings.tails.values()), self.token, self.config.trace_dir,
                        Profiler() if self.stack_taker is not None else None)  # fmt: skip
        http_logging.quiet_client_errors()
        # Slow clients (slowloris) hold a connection no longer than idle_timeout_s without a full request.
        self._runner = web.AppRunner(app, access_log=None, keepalive_timeout=self.config.idle_timeout_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        if self.shipper:
            self.shipper.start()
        log.info(
            "sidecar for %s/%s: rings in %s, collector %s, serving on port %d",
            self.config.namespace,
            self.config.job,
            self.config.trace_dir,
            self.config.collector_url or "(none)",
            self.port,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Poll and close windows until ``stop`` is set; then flush. ``start()`` must have run."""
        loop = asyncio.get_running_loop()
        next_window = loop.time() + self.config.window_s
        while not stop.is_set():
            try:
                report = self.poll()
                if report is not None:
                    self._write_megatrace(report)
                if loop.time() >= next_window:
                    self.close_window()
            except Exception:  # a bug or a ring no check foresaw must not end the watch: log, go on
                log.exception("sidecar step failed; continuing")
            if loop.time() >= next_window:
                while next_window <= loop.time():
                    next_window += self.config.window_s
            timeout = min(self.config.poll_s, max(0.0, next_window - loop.time()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout)
        await self.flush()

    async def flush(self) -> None:
        """The last poll, the last window, and a bounded wait for the collector to take them."""
        self.poll()
        self.close_window()
        if self._megatrace or self._stacks:
            await asyncio.wait(self._megatrace | self._stacks, timeout=self.config.shutdown_grace_s)
        if self.shipper and not await self.shipper.drain(self.config.shutdown_grace_s):
            log.warning("exiting with %d messages unsent (collector unreachable)", self.shipper.queued())

    async def close(self) -> None:
        if self.shipper:
            await self.shipper.close()
        if self._runner:
            await self._runner.cleanup()
        self.rings.close()

    def _write_megatrace(self, report: StallReport) -> None:
        paths = [tail.path for tail in self.newest_rings()]
        directory, save_count = Path(report.megatrace_dir or ""), self.watch.save_count

        async def write() -> None:
            try:
                written = await asyncio.to_thread(write_megatrace, paths, directory, save_count)
                log.warning(
                    "Megatrace logs of %d ranks written to %s (save_count %d)", len(written), directory, save_count
                )
            except Exception:  # a log we cannot write must not stop the watch
                log.exception("writing Megatrace logs to %s failed", directory)

        task = asyncio.create_task(write())
        self._megatrace.add(task)
        task.add_done_callback(self._megatrace.discard)


async def serve(config: SidecarConfig) -> None:
    sidecar = Sidecar(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await sidecar.start()
    try:
        await sidecar.run(stop)
    finally:
        await sidecar.close()
    log.info("stopped after %d windows", sidecar.summaries)


def main(config: SidecarConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    asyncio.run(serve(config))
    return 0
