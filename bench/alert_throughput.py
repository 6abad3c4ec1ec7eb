"""Alerts routed per second through the full alert pipeline to a local receiver.

.venv/bin/python bench/alert_throughput.py [--alerts 2000] [--batch 100]

Three figures, each end to end (alert in -> receiver answered 200 -> notification log committed):
  submit   : AlertPipeline.submit() of findings-shaped alerts, one group each, to the signed Feishu
             card receiver (HMAC signature computed and verified per card);
  intake   : the same through HTTP, as Alertmanager webhook payloads of --batch alerts each;
  grouped  : alerts grouped --batch per card (one job's alerts together).
The local Feishu runs in the same process and event loop, so it shares the CPU with the pipeline.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml
from prometheus_client import CollectorRegistry

from rankwatch.alerting import AlertPipeline, load_config, mapping_resolver, serve
from rankwatch.alerting.metrics import AlertMetrics
from rankwatch.alerting.model import Alert, Level
from rankwatch.alerting.webhook import alert_json

# The local Feishu is a test double: it lives with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
from fake_feishu import FakeFeishu


def config_text(feishu: FakeFeishu, store: Path, group_by: list[str]) -> str:
    return yaml.safe_dump(
        {
            "receivers": [
                {
                    "name": "team",
                    "feishu": {
                        "webhook_url": {"secretKeyRef": {"name": "bot", "key": "url"}},
                        "secret": {"secretKeyRef": {"name": "bot", "key": "secret"}},
                    },
                }
            ],
            "route": {"receiver": "team", "group_by": group_by, "group_wait": 0, "group_interval": "1h"},
            "storm": {"max_alerts": 10**9, "window": "1m"},  # measure the path, not the storm summary
            "delivery": {"concurrency": 8},
            "store": {"path": str(store)},
            "evaluation_interval": "10ms",
        }
    )


def alerts(count: int, run: str, per_job: int) -> list[Alert]:
    now = time.time()
    return [
        Alert(
            labels={
                "alertname": "TrainingJobStraggler",
                "namespace": "bench",
                "trainingjob": f"{run}-job-{i // per_job}",
                "node": f"gpu-node-{i}",
                "rank": str(i % 4096),
            },
            level=Level.P1,
            starts_at=now,
            annotations={"summary": f"rank {i} is slow", "evidence": '{"robust_z": 7.5, "wait_ms_p50": 41.0}'},
        )
        for i in range(count)
    ]


async def measure(name: str, count: int, batch: int, group_by: list[str], via_http: bool, per_job: int) -> None:
    async with FakeFeishu() as feishu:
        feishu.add_bot("bench", "bench-secret")
        secrets = mapping_resolver({"bot": {"url": feishu.bot_url("bench"), "secret": "bench-secret"}})
        with tempfile.TemporaryDirectory() as scratch:
            config = load_config(config_text(feishu, Path(scratch) / "a.sqlite", group_by), secrets)
            pipeline = AlertPipeline(config, metrics=AlertMetrics(CollectorRegistry()))
            await pipeline.start()
            runner, port = await serve(pipeline)
            todo = alerts(count, name, per_job)
            expected_cards = -(-count // per_job) if per_job > 1 else count
            try:
                started = time.perf_counter()
                async with aiohttp.ClientSession() as session:
                    for i in range(0, count, batch):
                        chunk = todo[i : i + batch]
                        if via_http:
                            payload = {
                                "version": "4",
                                "status": "firing",
                                "alerts": [alert_json(a, False) for a in chunk],
                            }
                            async with session.post(
                                f"http://127.0.0.1:{port}/alerting/alertmanager", json=payload
                            ) as r:
                                assert r.status == 200, await r.text()
                        else:
                            await pipeline.submit(chunk)
                accepted = time.perf_counter() - started
                while feishu.accepted < expected_cards:
                    await asyncio.sleep(0.005)
                await pipeline.wait_idle()
                total = time.perf_counter() - started
            finally:
                await runner.cleanup()
                await pipeline.stop()
    print(
        f"{name:8s} {count:6d} alerts {expected_cards:6d} cards  accepted {count / accepted:8.0f} alerts/s  "
        f"delivered {count / total:7.0f} alerts/s ({expected_cards / total:5.0f} cards/s, {total:5.2f} s)"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--alerts", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=100)
    args = parser.parse_args()
    every = ["alertname", "namespace", "trainingjob", "node"]
    await measure("submit", args.alerts, args.batch, every, via_http=False, per_job=1)
    await measure("intake", args.alerts, args.batch, every, via_http=True, per_job=1)
    await measure("grouped", args.alerts * 5, args.batch, ["alertname", "namespace", "trainingjob"], False, args.batch)


if __name__ == "__main__":
    asyncio.run(main())
