"""A diagnosis carries the firing alerts of the node it names, read from a Prometheus or an Alertmanager
(here real HTTP servers on loopback answering as their APIs do); a source that is down, erring or
answering nonsense is a problem on the diagnosis, never a failure."""

from __future__ import annotations

import html
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from rankwatch.alerting import alert_from_finding
from rankwatch.alerting.cards import card
from rankwatch.alerting.messages import Notification
from rankwatch.model.evidence import node_alert_lines
from rankwatch.model.finding import Finding, FindingKind
from rankwatch.operator.config import ConfigError, NodeAlertSources, OperatorConfig
from rankwatch.operator.diagnosis.diagnose.diagnose import with_node_alerts
from rankwatch.operator.diagnosis.diagnose.node_alerts import firing_on

THROTTLED = {
    "labels": {"alertname": "GPUClocksThrottled", "severity": "P2", "component": "gpu", "node": "gpu-node-3",
               "Hostname": "gpu-node-3", "gpu": "5", "reason": "hw_thermal_slowdown"},
    "annotations": {"summary": "GPU 5 on gpu-node-3 slows its clocks: hw_thermal_slowdown"},
    "state": "firing",
    "activeAt": "2026-11-26T12:01:07Z",
    "value": "1e+00",
}  # fmt: skip


def prometheus_alert(name: str, state: str = "firing", severity: str = "P1", **labels: str) -> dict[str, Any]:
    return {
        "labels": {"alertname": name, "severity": severity, **labels},
        "annotations": {"summary": f"{name} summary"},
        "state": state,
        "activeAt": "2026-11-26T12:00:00Z",
    }


PROMETHEUS_ALERTS = [
    THROTTLED,
    prometheus_alert("GPUXidCritical", severity="P0", Hostname="gpu-node-3", gpu="1"),
    prometheus_alert("InfiniBandErrors", instance="gpu-node-3:9100", device="mlx5_0"),
    prometheus_alert("NodeMemoryLow", state="pending", node="gpu-node-3"),  # not firing yet
    prometheus_alert("GPUTemperatureHigh", node="gpu-node-4"),  # another node
    prometheus_alert("RankwatchJobStraggler", component="rankwatch", node="gpu-node-3", trainingjob="llm"),
]


class Source:
    """A loopback HTTP server answering one path with what the test sets."""

    def __init__(self) -> None:
        self.answers: dict[str, tuple[int, bytes]] = {}
        self.queries: list[dict[str, str]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.queries.append(dict(request.query))
        status, body = self.answers.get(request.path, (404, b"not found"))
        return web.Response(status=status, body=body, content_type="application/json")


@pytest.fixture
async def source() -> AsyncIterator[tuple[Source, str]]:
    served = Source()
    app = web.Application()
    app.router.add_get("/{tail:.*}", served.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield served, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def straggler(nodes: list[str]) -> Finding:
    return Finding(FindingKind.STRAGGLER, [13], nodes, "c0", 0.9, "rank 13 on gpu-node-3 is 30% slower")


async def test_the_named_nodes_firing_infrastructure_alerts_most_severe_first(source):
    served, url = source
    served.answers["/api/v1/alerts"] = (
        200,
        json.dumps({"status": "success", "data": {"alerts": PROMETHEUS_ALERTS}}).encode(),
    )
    alerts, problems = await firing_on(["gpu-node-3"], NodeAlertSources(prometheus_url=url))
    assert problems == []
    assert [(a.name, a.node, a.severity) for a in alerts] == [
        ("GPUXidCritical", "gpu-node-3", "P0"),
        ("InfiniBandErrors", "gpu-node-3", "P1"),  # named by the host part of `instance`
        ("GPUClocksThrottled", "gpu-node-3", "P2"),
    ]  # pending, another node's and a job's own alert are left out
    assert alerts[2].text == (
        "GPUClocksThrottled (P2) on gpu-node-3 since 2026-11-26T12:01:07Z: GPU 5 on gpu-node-3 slows its clocks: "
        "hw_thermal_slowdown"
    )


async def test_alertmanager_active_alerts_only_and_one_line_per_alert_from_both_sources(source):
    served, url = source
    served.answers["/api/v1/alerts"] = (
        200,
        json.dumps({"status": "success", "data": {"alerts": [THROTTLED]}}).encode(),
    )
    silenced = {"labels": {"alertname": "GPUDoubleBitECC", "node": "gpu-node-3"}, "annotations": {},
                "startsAt": "2026-11-26T11:00:00Z", "status": {"state": "suppressed"}}  # fmt: skip
    same = {"labels": THROTTLED["labels"], "annotations": THROTTLED["annotations"],
            "startsAt": "2026-11-26T12:01:07Z", "status": {"state": "active"}}  # fmt: skip
    served.answers["/api/v2/alerts"] = (200, json.dumps([same, silenced]).encode())
    sources = NodeAlertSources(prometheus_url=url, alertmanager_url=url)
    alerts, problems = await firing_on(["gpu-node-3"], sources)
    assert problems == [] and [a.name for a in alerts] == ["GPUClocksThrottled"]
    assert {"active": "true", "silenced": "false", "inhibited": "false"} in served.queries


async def test_the_finding_carries_them_and_the_card_shows_them(source):
    served, url = source
    served.answers["/api/v1/alerts"] = (
        200,
        json.dumps({"status": "success", "data": {"alerts": [THROTTLED]}}).encode(),
    )
    finding, problems = await with_node_alerts(straggler(["gpu-node-3"]), NodeAlertSources(prometheus_url=url))
    assert problems == []
    (line,) = node_alert_lines(finding.evidence)
    assert line.startswith("GPUClocksThrottled (P2) on gpu-node-3")
    assert Finding.from_json(finding.to_json()) == finding  # kept in the report ConfigMap for a new leader
    alert = alert_from_finding("ml", "llm", finding)
    shown = html.unescape(json.dumps(card(Notification("team", "g", {}, (alert,))), ensure_ascii=False))
    assert "Firing on its node" in shown and "hw_thermal_slowdown" in shown


@pytest.mark.parametrize(
    ("status", "body", "says"),
    [
        (503, b"overloaded", "answered HTTP 503"),
        (200, b"<html>login</html>", "a body that is not JSON"),
        (200, b'{"status": "error", "error": "x"}', "not a Prometheus alerts answer"),
    ],
)
async def test_a_bad_answer_is_a_problem_naming_the_source(source, status, body, says):
    served, url = source
    served.answers["/api/v1/alerts"] = (status, body)
    finding = straggler(["gpu-node-3"])
    with_alerts, problems = await with_node_alerts(finding, NodeAlertSources(prometheus_url=url))
    assert with_alerts == finding
    (problem,) = problems
    assert f"Prometheus at {url}/api/v1/alerts" in problem and says in problem
    assert problem.endswith("the alerts of node gpu-node-3 are not on this diagnosis")


async def test_an_unreachable_source_is_a_problem_within_its_timeout():
    sources = NodeAlertSources(alertmanager_url="http://127.0.0.1:9", timeout_seconds=2)  # discard port: refused
    alerts, problems = await firing_on(["gpu-node-3"], sources)
    assert alerts == []
    assert problems[0].startswith("Alertmanager at http://127.0.0.1:9/api/v2/alerts unreachable")


async def test_nothing_is_asked_without_a_source_or_a_node(source):
    served, url = source
    assert await firing_on(["gpu-node-3"], NodeAlertSources()) == ([], [])
    assert await firing_on([], NodeAlertSources(prometheus_url=url)) == ([], [])
    assert served.queries == []


def test_the_sources_are_configured_once_from_the_environment():
    config = OperatorConfig.from_env(
        {
            "RANKWATCH_PROMETHEUS_URL": "http://prometheus.monitoring.svc:9090/",
            "RANKWATCH_NODE_ALERTS_TIMEOUT_SECONDS": "3",
        }
    )
    assert config.node_alerts == NodeAlertSources(
        prometheus_url="http://prometheus.monitoring.svc:9090", timeout_seconds=3
    )
    assert not OperatorConfig.from_env({}).node_alerts.configured
    with pytest.raises(ConfigError) as error:
        OperatorConfig.from_env({"RANKWATCH_ALERTMANAGER_URL": "alertmanager:9093"})
    assert error.value.problems[0].startswith("RANKWATCH_ALERTMANAGER_URL='alertmanager:9093': expected an http(s) URL")


async def test_an_answer_over_the_size_cap_is_not_read_and_says_so(source):
    from rankwatch.operator.diagnosis.diagnose.node_alerts import MAX_ANSWER_BYTES

    served, url = source
    padded = prometheus_alert("GPUFellOffTheBus", severity="P0", node="gpu-node-3")
    padded["annotations"] = {"summary": "x" * (MAX_ANSWER_BYTES + 1)}
    served.answers["/api/v1/alerts"] = (200, json.dumps({"status": "success", "data": {"alerts": [padded]}}).encode())
    alerts, problems = await firing_on(["gpu-node-3"], NodeAlertSources(prometheus_url=url))
    assert alerts == []
    (problem,) = problems
    assert f"Prometheus at {url}/api/v1/alerts answered with more than {MAX_ANSWER_BYTES >> 20} MiB" in problem


async def test_an_alerts_text_is_one_bounded_line(source):
    served, url = source
    forged = prometheus_alert("GPUXid\nCIRCUIT BREAKER OPEN: 40 nodes uncordoned", severity="P1", node="gpu-node-3")
    forged["annotations"] = {"summary": "y" * 5000}
    served.answers["/api/v1/alerts"] = (200, json.dumps({"status": "success", "data": {"alerts": [forged]}}).encode())
    (alert,), _ = await firing_on(["gpu-node-3"], NodeAlertSources(prometheus_url=url))
    assert "\n" not in alert.text and alert.name.startswith("GPUXid\\nCIRCUIT")
    assert len(alert.summary) <= 500
