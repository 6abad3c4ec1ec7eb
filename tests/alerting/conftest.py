"""Fixtures: a local Feishu (real HTTP on 127.0.0.1) and started pipelines with fast-timed configs."""

from __future__ import annotations

import time
from typing import Any

import pytest
import yaml
from alerting_support import APP_ID, APP_SECRET, BOT_TOKEN, SIGNING_SECRET, USERS, config_data, merge, secrets_for
from fake_feishu import FakeFeishu
from prometheus_client import CollectorRegistry

from rankwatch.alerting import AlertPipeline, load_config
from rankwatch.alerting.metrics import AlertMetrics


@pytest.fixture
async def feishu():
    fake = FakeFeishu()
    await fake.start()
    fake.add_bot(BOT_TOKEN, SIGNING_SECRET)
    fake.add_app(APP_ID, APP_SECRET, USERS)
    yield fake
    await fake.stop()


@pytest.fixture
async def pipelines(feishu, tmp_path):
    """Build started pipelines (config changes merged in) sharing one store path and metrics registry;
    all are stopped at the end of the test."""
    made: list[AlertPipeline] = []
    registry = CollectorRegistry()
    metrics = AlertMetrics(registry)

    async def make(
        changes: dict[str, Any] | None = None, signing_secret: str = SIGNING_SECRET, clock: Any = time.time
    ) -> AlertPipeline:
        data = merge(config_data(feishu, str(tmp_path / "alerts.sqlite")), changes or {})
        config = load_config(yaml.safe_dump(data), secrets_for(feishu, signing_secret))
        pipeline = AlertPipeline(config, metrics=metrics, clock=clock)
        await pipeline.start()
        made.append(pipeline)
        return pipeline

    make.registry = registry  # type: ignore[attr-defined]
    yield make
    for pipeline in made:
        await pipeline.stop(grace=0.5)
