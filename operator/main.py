"""`rankwatch operator`: one process per replica; the one holding the Lease runs everything.

    start ─► probes (/healthz, /readyz) ─► wait for the Lease (standby: alive, not ready)
          ─► leader: kopf (handlers, and at its start-up the collector, monitor and alerting)
          ─► ready once kopf's start-up is done ─► renew the Lease every second
    SIGTERM: kopf stops (its cleanup stops the watch), the Lease is given up at once, exit 0.
    Lease lost (not renewable before the deadline): kopf stops, exit 1; Kubernetes restarts the
    container, which comes back as a standby.

kopf runs standalone (no kopf peering): the Lease, not kopf, decides who acts, and it decides for
everything this process does. Everything the leader knows of a job comes from the API server and
the sidecars' next summaries, so a new leader needs nothing from the old one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import kopf

from rankwatch import tenant_text
from rankwatch.kube import api_client
from rankwatch.operator import event_loop, garbage_collection, kopf_toggles
from rankwatch.operator.config import OperatorConfig
from rankwatch.operator.leadership import Lease
from rankwatch.operator.probes import ProbeServer, Readiness

log = logging.getLogger(__name__)

LOST_LEADERSHIP = 1


def run(config: OperatorConfig) -> int:
    """Run until stopped; the exit status of the process."""
    import rankwatch.operator.handlers  # noqa: F401  (registers the handlers)

    configure_logging()
    kopf_toggles.wake_only_on_flips()
    garbage_collection.tune()
    return event_loop.run(_run(config), config.event_loop)


def configure_logging() -> None:
    """kopf's log format on stderr, every record one line: a job's text (its frames, names, a server's
    error body) in a message never starts a log line of its own."""
    kopf.configure(verbose=False)
    tenant_text.one_line_logs()


async def _run(config: OperatorConfig) -> int:
    loop = asyncio.get_running_loop()
    log.info("event loop: %s (%s)", config.event_loop, type(loop).__module__)
    kube = api_client(request_timeout=config.api_timeout_seconds)
    readiness = Readiness()
    probes = ProbeServer(*config.probe_listen, readiness) if config.probe_listen else None
    if probes:
        await probes.start()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    lease = Lease(kube, config.leader) if config.leader.enabled else None
    thaw = asyncio.create_task(garbage_collection.thaw_periodically(), name="gc-thaw")
    try:
        if lease is not None:
            readiness.set(False, f"standby: waiting for {lease.name}")
            if not await _first(lease.acquire(), stop.wait()):
                return 0
        return await _lead(config, kube, lease, readiness)
    finally:
        thaw.cancel()
        readiness.set(False, "stopped")
        if lease is not None:
            await lease.release()
        if probes:
            await probes.stop()


async def _lead(config: OperatorConfig, kube: object, lease: Lease | None, readiness: Readiness) -> int:
    stop_kopf, kopf_ready = asyncio.Event(), asyncio.Event()
    memo = kopf.Memo(config=config, kube=kube, leading=lease.held if lease else (lambda: True))
    operator = asyncio.create_task(
        kopf.operator(
            standalone=True,
            clusterwide=not config.namespaces,
            namespaces=list(config.namespaces),
            memo=memo,
            stop_flag=stop_kopf,
            ready_flag=kopf_ready,
        ),
        name="kopf",
    )
    held = asyncio.create_task(lease.hold() if lease else asyncio.Event().wait(), name="lease")

    async def report_ready() -> None:
        await kopf_ready.wait()
        # kopf stops on signals by its own handlers, then waits 5 s for the waiter of our stop flag;
        # through the flag it stops at once.
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop_kopf.set)
        readiness.set(True, "leader" if lease else "running")

    ready = asyncio.create_task(report_ready())
    done, _ = await asyncio.wait({operator, held}, return_when=asyncio.FIRST_COMPLETED)
    readiness.set(False, "stopping")
    ready.cancel()
    status = 0
    if held in done:  # the Lease is lost: stop acting before anyone else may start
        status = LOST_LEADERSHIP
        stop_kopf.set()
        with contextlib.suppress(Exception):
            await operator
    else:
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held
        if not operator.cancelled() and operator.exception() is not None:
            log.error("the operator stopped on an error", exc_info=operator.exception())
            status = 1
    return status


async def _first(winner: object, loser: object) -> bool:
    """Await two coroutines until the first finishes; True when it was ``winner``."""
    first, second = asyncio.ensure_future(winner), asyncio.ensure_future(loser)  # type: ignore[arg-type]
    done, pending = await asyncio.wait({first, second}, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return first in done
