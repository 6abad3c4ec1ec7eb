"""An alerting config that cannot be used leaves the operator running without alerting, and says so."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from rankwatch.alerting.metrics import AlertMetrics
from rankwatch.operator.alerting_start import start_alerting
from rankwatch.operator.config import AlertingSettings


def test_a_bad_alerting_config_returns_no_pipeline_and_reports_not_ready(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("POD_NAME", raising=False)  # outside a pod: no Event, the metric and the log remain
    config = tmp_path / "alerting.yaml"
    config.write_text("route: {receiver: nobody}\n")  # no receivers
    registry = CollectorRegistry()
    pipeline = asyncio.run(
        start_alerting(AlertingSettings(config_path=str(config)), None, lambda: AlertMetrics(registry))
    )
    assert pipeline is None
    assert registry.get_sample_value("rankwatch_alerting_ready") == 0
    assert "alerting is off until the operator restarts" in caplog.text and "receivers" in caplog.text


def test_alerting_off_starts_nothing():
    registry = CollectorRegistry()
    assert asyncio.run(start_alerting(AlertingSettings(config_path=None), None, lambda: AlertMetrics(registry))) is None
    assert registry.get_sample_value("rankwatch_alerting_ready") is None, "alerting off: no readiness series"
