"""Helpers for the alerting tests: secrets from a mapping, fast-timed configs, alerts, waiting."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from typing import Any

from fake_feishu import FakeFeishu
from prometheus_client import CollectorRegistry

from rankwatch.alerting import mapping_resolver
from rankwatch.alerting.model import Alert, Level

BOT_TOKEN = "b0t-t0ken-7f3a9c"
SIGNING_SECRET = "s1gning-s3cret-9d8e"
APP_ID = "cli_a1b2c3"
APP_SECRET = "app-s3cret-5e6f7a"
USERS = ["u-alice", "u-bob", "u-carol"]
SECRET_VALUES = [BOT_TOKEN, SIGNING_SECRET, APP_SECRET]
INTAKE_TOKEN = "intake-t0ken"


def secrets_for(feishu: FakeFeishu, signing_secret: str = SIGNING_SECRET) -> Callable[[str, str], str]:
    return mapping_resolver(
        {
            "feishu-bot": {"webhook-url": feishu.bot_url(BOT_TOKEN), "signing-secret": signing_secret},
            "feishu-app": {"app-id": APP_ID, "app-secret": APP_SECRET},
            "intake": {"token": INTAKE_TOKEN},
        }
    )


def config_data(feishu: FakeFeishu, store_path: str) -> dict[str, Any]:
    """Routes as a real deployment would have them, with every interval short enough for tests."""
    return {
        "receivers": [
            {
                "name": "team",
                "feishu": {
                    "webhook_url": {"secretKeyRef": {"name": "feishu-bot", "key": "webhook-url"}},
                    "secret": {"secretKeyRef": {"name": "feishu-bot", "key": "signing-secret"}},
                    "mentions": ["u-alice", "all"],
                },
            },
            {
                "name": "oncall-phone",
                "feishu_phone": {
                    "base_url": feishu.base_url,
                    "app_id": {"secretKeyRef": {"name": "feishu-app", "key": "app-id"}},
                    "app_secret": {"secretKeyRef": {"name": "feishu-app", "key": "app-secret"}},
                    "user_ids": list(USERS),
                },
            },
            {"name": "ops-hook", "webhook": {"url": f"{feishu.base_url}/webhook/ops"}},
        ],
        "route": {
            "receiver": "team",
            "group_by": ["alertname", "namespace", "trainingjob", "node"],
            "group_wait": "50ms",
            "group_interval": "150ms",
            "repeat_interval": "1h",
            "routes": [
                {"matchers": ['level="P0"'], "receiver": "oncall-phone", "continue": True},
                {"matchers": ['team="ops"'], "receiver": "ops-hook"},
                {"receiver": "team"},
            ],
        },
        "inhibit_rules": [
            {
                "source_matchers": ['alertname="NodeDown"'],
                "target_matchers": ['level=~"P1|P2"', 'trainingjob=~".+"'],
                "equal": ["node"],
            }
        ],
        "storm": {"max_alerts": 50, "window": "1s"},
        "delivery": {"timeout": "2s", "attempts": 3, "backoff": "20ms", "max_backoff": "200ms"},
        "store": {"path": store_path},
        "evaluation_interval": "20ms",
        "intake": {"bearer_token": {"secretKeyRef": {"name": "intake", "key": "token"}}},
    }


def merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    result = copy.deepcopy(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merge(result[key], value)
        else:
            result[key] = value
    return result


async def wait_for(predicate: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def job_alert(
    job: str = "llama-70b",
    node: str = "gpu-node-1",
    level: Level = Level.P1,
    name: str = "TrainingJobStraggler",
    **annotations: str,
) -> Alert:
    return Alert(
        labels={"alertname": name, "namespace": "ml", "trainingjob": job, "node": node, "rank": "13"},
        level=level,
        starts_at=time.time(),
        annotations={"summary": f"rank 13 on {node} is slow", **annotations},
    )


class SkewedClock:
    """Wall-clock time that a test can move forward: a window that ends when the test says, not when a
    loaded machine happens to get there."""

    def __init__(self) -> None:
        self.skew = 0.0

    def __call__(self) -> float:
        return time.time() + self.skew

    def advance(self, seconds: float) -> None:
        self.skew += seconds


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0
