"""The operator's configuration: built once from the environment, every bad value named at start-up."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rankwatch.operator.config import ConfigError, OperatorConfig


def test_defaults_build_and_every_section_is_filled():
    config = OperatorConfig.from_env({})
    assert config.collector.port == 8080 and config.collector.burst_per_job == 10 * config.collector.rate_per_job
    assert config.diagnosis.concurrency == 2 and config.diagnosis.worker_memory_bytes == 256 << 20
    assert config.safeguards.breaker.max_share == 0.10 and config.leader.enabled
    assert config.leader.lease_namespace == "default" and config.leader.identity
    assert config.alerting.config_path is None and config.probe_listen is None
    assert config.api_timeout_seconds == 30.0


def test_settings_are_read_into_their_sections(tmp_path):
    alerting = tmp_path / "alerting.yaml"
    alerting.write_text("receivers: []\n")
    config = OperatorConfig.from_env(
        {
            "RANKWATCH_BREAKER_MAX_SHARE": "0.5",
            "RANKWATCH_BREAKER_WINDOW_SECONDS": "300",
            "RANKWATCH_CORDON_COOLDOWN_SECONDS": "60",
            "RANKWATCH_CORDON_MAX_NODES_PER_NAMESPACE": "2",
            "RANKWATCH_CORDON_MAX_NODES": "8",
            "RANKWATCH_CORDON_SHARED_EXPIRY_SECONDS": "900",
            "RANKWATCH_COLLECTOR_LISTEN": "127.0.0.1:0",
            "RANKWATCH_PROBE_LISTEN": ":8081",
            "RANKWATCH_METRICS_LISTEN": "0.0.0.0:9090",
            "RANKWATCH_ARCHIVE_BUDGET_MIB": "256",
            "RANKWATCH_DIAGNOSIS_CONCURRENCY": "4",
            "RANKWATCH_DIAGNOSIS_MEMORY_MIB": "2048",
            "RANKWATCH_ALERTING_CONFIG": str(alerting),
            "POD_NAMESPACE": "rankwatch-system",
            "POD_NAME": "rankwatch-operator-7d9-x2",
            "RANKWATCH_API_TIMEOUT_SECONDS": "7.5",
            "RANKWATCH_EVENT_LOOP": "uvloop",
        },
        namespaces=("team-*",),
    )
    guards = config.safeguards
    assert (guards.breaker.max_share, guards.breaker.window_seconds, guards.cooldown_seconds) == (0.5, 300, 60)
    assert (guards.max_nodes_per_namespace, guards.max_nodes, guards.shared_expiry_seconds) == (2, 8, 900)
    assert (config.collector.host, config.collector.port, config.probe_listen) == ("127.0.0.1", 0, ("0.0.0.0", 8081))
    assert config.diagnosis.worker_memory_bytes == 512 << 20
    assert config.metrics_listen == ("0.0.0.0", 9090) and not config.collector.serves_metrics
    assert config.archive_budget_bytes == 256 << 20
    assert config.alerting.config_path == str(alerting) and config.alerting.namespace == "rankwatch-system"
    assert config.leader.lease_namespace == "rankwatch-system" and config.leader.identity.startswith(
        "rankwatch-operator-7d9-x2_"
    )
    assert config.namespaces == ("team-*",) and config.api_timeout_seconds == 7.5
    assert config.event_loop == "uvloop"


def test_every_bad_value_is_named_with_its_variable_and_what_is_expected(tmp_path):
    with pytest.raises(ConfigError) as caught:
        OperatorConfig.from_env(
            {
                "RANKWATCH_BREAKER_MAX_SHARE": "50",
                "RANKWATCH_CORDON_MIN_CONFIDENCE": "high",
                "RANKWATCH_COLLECTOR_LISTEN": "8080",
                "RANKWATCH_COLLECTOR_URL": "rankwatch-collector:8080",
                "RANKWATCH_SIDECAR_METRICS_PORT": "70000",
                "RANKWATCH_DIAGNOSIS_CONCURRENCY": "0",
                "RANKWATCH_ALERTING_CONFIG": str(tmp_path / "missing.yaml"),
                "RANKWATCH_STATUS_DEBOUNCE_SECONDS": "-1",
                "RANKWATCH_API_TIMEOUT_SECONDS": "0",
                "RANKWATCH_EVENT_LOOP": "trio",
            }
        )
    problems = caught.value.problems
    assert problems == [
        "RANKWATCH_COLLECTOR_URL='rankwatch-collector:8080': expected an http(s) URL, e.g. "
        "http://rankwatch-collector.rankwatch-system.svc:8080",
        "RANKWATCH_SIDECAR_METRICS_PORT='70000': not a port (1-65535)",
        "RANKWATCH_COLLECTOR_LISTEN='8080': expected host:port, e.g. 0.0.0.0:8080 (port 0: any free port)",
        "RANKWATCH_DIAGNOSIS_CONCURRENCY='0': must be at least 1",
        "RANKWATCH_BREAKER_MAX_SHARE='50': must be within [0, 1]",
        "RANKWATCH_CORDON_MIN_CONFIDENCE='high': not a number",
        f"RANKWATCH_ALERTING_CONFIG='{tmp_path / 'missing.yaml'}': no such file (the alerting config is mounted "
        "from a ConfigMap)",
        "RANKWATCH_STATUS_DEBOUNCE_SECONDS='-1': must not be negative",
        "RANKWATCH_API_TIMEOUT_SECONDS='0': must be greater than 0",
        "RANKWATCH_EVENT_LOOP='trio': must be one of asyncio, uvloop",
    ]


def test_the_admin_decides_whether_jobs_may_give_their_sidecar_ptrace():
    assert OperatorConfig.from_env({}).pods.allow_ptrace is True
    assert OperatorConfig.from_env({"RANKWATCH_SIDECAR_ALLOW_PTRACE": "false"}).pods.allow_ptrace is False
    with pytest.raises(ConfigError, match=r"RANKWATCH_SIDECAR_ALLOW_PTRACE='no': expected true or false"):
        OperatorConfig.from_env({"RANKWATCH_SIDECAR_ALLOW_PTRACE": "no"})


def test_settings_that_only_fail_together_are_named_together():
    with pytest.raises(ConfigError, match=r"RANKWATCH_DIAGNOSIS_MEMORY_MIB=256: leaves 64 MiB per diagnosis with "
                       r"RANKWATCH_DIAGNOSIS_CONCURRENCY=4"):  # fmt: skip
        OperatorConfig.from_env({"RANKWATCH_DIAGNOSIS_MEMORY_MIB": "256", "RANKWATCH_DIAGNOSIS_CONCURRENCY": "4"})
    with pytest.raises(ConfigError, match=r"RENEW_DEADLINE_SECONDS < RANKWATCH_LEASE_DURATION_SECONDS must hold"):
        OperatorConfig.from_env(
            {"RANKWATCH_LEASE_DURATION_SECONDS": "5", "RANKWATCH_LEASE_RENEW_DEADLINE_SECONDS": "9"}
        )


def test_a_bad_value_stops_the_operator_before_it_does_anything():
    """The command exits 2 naming the variable; it never reaches for a cluster (none is configured)."""
    env = {
        **os.environ,
        "RANKWATCH_BREAKER_MAX_SHARE": "1.5",
        "KUBECONFIG": "/nonexistent/kubeconfig",
        "PYTHONUNBUFFERED": "1",
    }
    result = subprocess.run(
        [sys.executable, "-m", "rankwatch", "operator", "--standalone"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "rankwatch operator: bad configuration:\n  RANKWATCH_BREAKER_MAX_SHARE='1.5': must be within [0, 1]\n"
    )
