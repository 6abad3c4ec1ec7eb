"""``rankwatch alerts report`` and ``rankwatch alerts test``: on-demand messages from the command line.

Run anywhere the store is reachable: the chart's store (ConfigMaps in the operator's namespace)
wherever they can be read, a SQLite store where the file is (or a copy). They only open the store
and send: nothing of the operator's alert groups is evaluated, so running them beside the operator
never sends a page twice.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from rankwatch.alerting import cards
from rankwatch.alerting.cluster_store import open_store
from rankwatch.alerting.config import AlertingConfig, ConfigError, load_config
from rankwatch.alerting.delivery import DeliveryError
from rankwatch.alerting.metrics import AlertMetrics
from rankwatch.alerting.model import Level
from rankwatch.alerting.pipeline import AlertPipeline
from rankwatch.alerting.secrets import SecretResolver, file_resolver, kubernetes_resolver
from rankwatch.alerting.store import AlertStore, StoreError

DEFAULT_CONFIG = "/etc/rankwatch/alerting/config.yaml"


def _namespace(namespace: str | None) -> str:
    return namespace or os.environ.get("POD_NAMESPACE", "rankwatch-system")


def _resolver(secrets_file: str | None, namespace: str | None) -> SecretResolver:
    if secrets_file:
        return file_resolver(secrets_file)
    from rankwatch.kube import api_client

    return kubernetes_resolver(_namespace(namespace), api_client())


def _config(path: str | None, secrets_file: str | None, namespace: str | None, store: str | None) -> AlertingConfig:
    path = path or os.environ.get("RANKWATCH_ALERTING_CONFIG", DEFAULT_CONFIG)
    config = load_config(Path(path), _resolver(secrets_file, namespace))
    if store:
        from dataclasses import replace

        config = replace(config, store=replace(config.store, path=store))
    return config


def report(
    config_path: str | None,
    secrets_file: str | None,
    namespace: str | None,
    store: str | None,
    receiver: str | None,
    print_only: bool,
) -> int:
    try:
        config = _config(config_path, secrets_file, namespace, store)
        if config.store.path and not Path(config.store.path).exists():
            raise StoreError(f"no alert store at {config.store.path} (give --store)")
        return asyncio.run(_report(config, _namespace(namespace), receiver, print_only))
    except (ConfigError, StoreError, ValueError, OSError) as error:
        print(f"rankwatch alerts report: {error}", file=sys.stderr)
        return 1


async def _report(config: AlertingConfig, namespace: str, receiver: str | None, print_only: bool) -> int:
    kube = None
    if not config.store.path:
        from rankwatch.kube import api_client

        kube = api_client()
    store = open_store(config.store, kube, namespace)
    pipeline = AlertPipeline(config, store=store)
    await pipeline.start(evaluate=False)
    try:
        if print_only:
            built = pipeline.build_report(receiver or config.report.receiver or next(iter(config.receivers)))
            print(json.dumps(cards.card(built), ensure_ascii=False, indent=2))
            return 0
        try:
            built = await pipeline.send_report(receiver)
        except DeliveryError as error:
            print(f"rankwatch alerts report: {error}", file=sys.stderr)
            return 1
    finally:
        await pipeline.stop()
        store.close()
    counts = ", ".join(f"{level} {count}" for level, count in built.counts.items())
    print(f"sent the weekly report to {built.receiver}: {built.total} alerts ({counts})")
    return 0


def test(config_path: str | None, secrets_file: str | None, namespace: str | None, receiver: str, level: str) -> int:
    try:
        config = _config(config_path, secrets_file, namespace, store=":memory:")
        return asyncio.run(_test(config, receiver, Level.parse(level)))
    except (ConfigError, ValueError, OSError) as error:
        print(f"rankwatch alerts test: {error}", file=sys.stderr)
        return 1


async def _test(config: AlertingConfig, receiver: str, level: Level) -> int:
    if receiver not in config.receivers:
        print(
            f"rankwatch alerts test: no receiver named {receiver!r} (defined: {', '.join(config.receivers)})",
            file=sys.stderr,
        )
        return 2
    pipeline = AlertPipeline(config, store=AlertStore(":memory:"))
    await pipeline.start(evaluate=False)
    try:
        await pipeline.send_test(receiver, level)
    except DeliveryError as error:
        print(f"rankwatch alerts test: {error}", file=sys.stderr)
        return 1
    finally:
        await pipeline.stop()
    print(f"sent a {level} test {'call' if pipeline.receivers[receiver].rings else 'card'} to {receiver}")
    return 0


def serve(config_path: str | None, secrets_file: str | None, namespace: str | None, listen: str) -> int:
    """`rankwatch alerts serve`: the alert pipeline and its Alertmanager intake without the operator."""
    host, _, port = listen.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        print(f"rankwatch alerts serve: --listen {listen!r}: expected HOST:PORT", file=sys.stderr)
        return 2
    try:
        config = _config(config_path, secrets_file, namespace, store=None)
    except (ConfigError, OSError) as error:
        print(f"rankwatch alerts serve: {error}", file=sys.stderr)
        return 1
    if config.intake.bearer_token is None:
        print(
            "rankwatch alerts serve: the config sets no intake.bearer_token: the intake would refuse every "
            "request. Add intake: {bearer_token: {secretKeyRef: {name: ..., key: ...}}} and give Alertmanager "
            "the same token (http_config.authorization.credentials_file)",
            file=sys.stderr,
        )
        return 1
    return asyncio.run(_serve(config, host or "127.0.0.1", int(port)))


async def _serve(config: AlertingConfig, host: str, port: int) -> int:
    import signal

    from aiohttp import web
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

    from rankwatch.alerting.intake import add_routes

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    pipeline = AlertPipeline(config, metrics=AlertMetrics(REGISTRY))  # this process's series, served below
    await pipeline.start()
    app = web.Application()
    add_routes(app, pipeline)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as error:
            print(f"rankwatch alerts serve: cannot listen on {host}:{port}: {error.strerror}", file=sys.stderr)
            return 1
        bound = runner.addresses[0][1]
        print(f"rankwatch alerts: Alertmanager webhook at http://{host}:{bound}/alerting/alertmanager", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()
        await pipeline.stop()
    return 0
