"""The tests' monitoring stack: the local cluster's Prometheus and Alertmanager with the chart's rules (hold
times cut for tests), a Prometheus API client, and an exporter serving the series a GPU node's exporters would."""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

RULES = Path(__file__).parents[2] / "helm" / "rankwatch" / "rules" / "rankwatch-rules.yaml"


FOR_IN_TESTS = "2s"


def get(url: str, timeout: float = 10, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except OSError:
        return 0, b""


def rules_for_tests(directory: Path) -> Path:
    """The chart's rules, every ``for:`` cut to FOR_IN_TESTS; expressions, labels, annotations as shipped."""
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = FOR_IN_TESTS
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RULES.name
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return path


def start_monitoring(**alertmanager: str) -> Any:
    """The tests' local cluster with its Prometheus and Alertmanager up (scraping and evaluating every
    second, the chart's rules with test hold times); skips on an external cluster, which has neither."""
    if os.environ.get("RANKWATCH_USE_KUBECONFIG") == "1":
        pytest.skip("the monitoring stack runs beside the built-in local cluster, not an external one")
    from rankwatch.cluster.local import LocalCluster
    from rankwatch.cluster.monitoring import LocalMonitoring, MonitoringSettings

    cluster = LocalCluster(
        Path(os.environ.get("RANKWATCH_TEST_CLUSTER_DIR") or "~/.rankwatch/test-cluster").expanduser()
    )
    settings = MonitoringSettings(
        scrape_interval="1s",
        evaluation_interval="1s",
        rule_files=(rules_for_tests(cluster.root / "monitoring" / "test-rules"),),
        **alertmanager,
    )
    cluster.up(log=lambda message: print(f"[cluster] {message}", flush=True), monitoring=settings)
    return LocalMonitoring(cluster)


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params: Any) -> Any:
        status, body = get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=30)
        assert status == 200, f"Prometheus {path} {params}: HTTP {status}: {body[:500]!r}"
        return json.loads(body)["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def firing(self, alertname: str, **labels: str) -> list[dict[str, Any]]:
        return [
            a
            for a in self.api("alerts")["alerts"]
            if a["state"] == "firing"
            and a["labels"]["alertname"] == alertname
            and all(a["labels"].get(k) == v for k, v in labels.items())
        ]

    def selectors(self, expr: str) -> set[str]:
        """Metric names an expression reads, from Prometheus' own parser (/api/v1/parse_query)."""
        names: set[str] = set()

        def walk(node: Any) -> None:
            if isinstance(node, dict):
                if node.get("type") in ("vectorSelector", "matrixSelector") and node.get("name"):
                    names.add(node["name"])
                for value in node.values():
                    walk(value)
            elif isinstance(node, list):
                for value in node:
                    walk(value)

        walk(self.api("parse_query", query=expr))
        return names


class Exporter(ThreadingHTTPServer):
    """An exporter's /metrics with the series a GPU node's dcgm-exporter and node-exporter serve (there is
    no GPU or InfiniBand here); the text changes as the test says."""

    def __init__(self) -> None:
        self.text = ""

        class Handler(BaseHTTPRequestHandler):
            def do_GET(handler) -> None:
                body = self.text.encode()
                handler.send_response(200)
                handler.send_header("Content-Type", "text/plain; version=0.0.4")
                handler.send_header("Content-Length", str(len(body)))
                handler.end_headers()
                handler.wfile.write(body)

            def log_message(handler, *_: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"
