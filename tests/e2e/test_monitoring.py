"""rankwatch inside a real Prometheus and Alertmanager (built from their Go modules, run beside the local
control plane): the chart's rules evaluated on the series the operator and the sidecars export, alerts
routed by Alertmanager to rankwatch's intake (`rankwatch alerts serve`, a process of its own) and from
there to Feishu (the local Feishu of tests/alerting), cards and phone calls.

The session operator runs without an alerting config: rankwatch's own alerting is off, so every page
seen here went Prometheus -> Alertmanager -> intake. Prometheus scrapes and evaluates every second;
the rules are the chart's file with each ``for:`` cut to a few seconds (their hold times are
promtool-tested in tests/deploy); their expressions are as shipped.
"""

from __future__ import annotations

import asyncio
import html
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from fake_feishu import FakeFeishu
from monitoring_stack import RULES, Exporter, Prometheus, get, start_monitoring
from prometheus_client.parser import text_string_to_metric_families
from trainingjobs import STRAGGLER, create_job, diagnosed, standin_job  # 2 pods x 4 ranks on the stand-in NCCL

pytestmark = pytest.mark.e2e

REPO = Path(__file__).parents[2]
DASHBOARD = REPO / "helm" / "rankwatch" / "dashboards" / "rankwatch.json"
BOT_TOKEN, SIGNING_SECRET = "m0nitoring-bot", "m0nitoring-signing"
APP_ID, APP_SECRET, ONCALL = "cli_m0n", "m0n-app-secret", ["u-oncall-1", "u-oncall-2"]
INTAKE_TOKEN = "m0nitoring-intake-token"
THIRD_PARTY_PREFIXES = ("kube_", "DCGM_", "node_")
"""Series of kube-state-metrics, dcgm-exporter and node-exporter: not rankwatch's to export."""


# ---- the stack -----------------------------------------------------------------------------------------
class LoopThread:
    """An asyncio loop in a thread, for the aiohttp Feishu beside these synchronous tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def feishu() -> Iterator[FakeFeishu]:
    loop = LoopThread()
    fake = loop.run(FakeFeishu().start())
    fake.add_bot(BOT_TOKEN, SIGNING_SECRET)
    fake.add_app(APP_ID, APP_SECRET, ONCALL)
    yield fake
    loop.run(fake.stop())
    loop.close()


def receiver_config(feishu: FakeFeishu, store: Path) -> dict[str, Any]:
    """Routes as a site would have them: every alert a card, P0 also a phone call to the on-call."""
    return {
        "receivers": [
            {
                "name": "gpu-team",
                "feishu": {
                    "webhook_url": {"secretKeyRef": {"name": "feishu-bot", "key": "webhook-url"}},
                    "secret": {"secretKeyRef": {"name": "feishu-bot", "key": "signing-secret"}},
                },
            },
            {
                "name": "oncall-phone",
                "feishu_phone": {
                    "base_url": feishu.base_url,
                    "app_id": {"secretKeyRef": {"name": "feishu-app", "key": "app-id"}},
                    "app_secret": {"secretKeyRef": {"name": "feishu-app", "key": "app-secret"}},
                    "user_ids": ONCALL,
                },
            },
        ],
        "route": {
            "receiver": "gpu-team",
            "group_by": ["alertname", "namespace", "trainingjob", "node"],
            "group_wait": "0s",
            "group_interval": "1s",
            "repeat_interval": "1h",
            "routes": [
                {"matchers": ['level="P0"'], "receiver": "oncall-phone", "continue": True},
                {"receiver": "gpu-team"},
            ],
        },
        "intake": {"bearer_token": {"secretKeyRef": {"name": "intake", "key": "token"}}},
        "delivery": {"timeout": "5s", "attempts": 3, "backoff": "100ms", "max_backoff": "1s"},
        "store": {"path": str(store)},
        "evaluation_interval": "100ms",
    }


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def receiver(feishu: FakeFeishu, tmp_path_factory: pytest.TempPathFactory, eventually: Any) -> Iterator[str]:
    """`rankwatch alerts serve`: the Alertmanager intake and the alert pipeline, without the operator."""
    directory = tmp_path_factory.mktemp("receiver")
    config = directory / "alerting.yaml"
    config.write_text(yaml.safe_dump(receiver_config(feishu, directory / "alerts.sqlite")))
    secrets = directory / "secrets.yaml"
    secrets.write_text(
        yaml.safe_dump(
            {
                "feishu-bot": {"webhook-url": feishu.bot_url(BOT_TOKEN), "signing-secret": SIGNING_SECRET},
                "feishu-app": {"app-id": APP_ID, "app-secret": APP_SECRET},
                "intake": {"token": INTAKE_TOKEN},
            }
        )
    )
    secrets.chmod(0o600)
    address = f"127.0.0.1:{free_port()}"
    log = directory / "receiver.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "rankwatch", "alerts", "serve", "--config", str(config), "--secrets", str(secrets),
             "--listen", address],
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        url = f"http://{address}"
        eventually(lambda: get(f"{url}/metrics")[0] == 200, 30, what=f"rankwatch alerts serve on {address}")
        yield url
    finally:
        process.terminate()
        process.wait(15)
        print(log.read_text()[-2000:])


@pytest.fixture(scope="module")
def monitoring(kubeconfig: str, operator: Any, collector_url: str, receiver: str, tmp_path_factory) -> Iterator[Any]:
    """Prometheus and Alertmanager of the tests' local cluster, scraping the session operator, the pod
    runner's sidecars and the receiver, sending P0-P3 alerts to the receiver's intake."""
    stack = start_monitoring(group_wait="1s", group_interval="2s", repeat_interval="1h")
    token = tmp_path_factory.mktemp("alertmanager") / "intake-token"
    token.write_text(INTAKE_TOKEN)
    stack.scrape("rankwatch-operator", [urllib.parse.urlsplit(collector_url).netloc])
    stack.scrape("rankwatch-alerts", [urllib.parse.urlsplit(receiver).netloc])
    stack.route_alerts_to(f"{receiver}/alerting/alertmanager", str(token))
    try:
        yield stack
    finally:
        for job in ("rankwatch-operator", "rankwatch-alerts", "dcgm-exporter", "node-exporter"):
            stack.scrape(job, [])
        stack.route_alerts_to(None)


@pytest.fixture(scope="module")
def prometheus(monitoring: Any) -> Prometheus:
    return Prometheus(monitoring.prometheus_url)


# ---- what reached Feishu --------------------------------------------------------------------------------
def cards_about(feishu: FakeFeishu, *words: str) -> list[dict[str, Any]]:
    """Firing cards mentioning all ``words`` (Alertmanager may also deliver an earlier run's resolved ones)."""
    return [
        card
        for card in feishu.cards()
        if not card["header"]["title"]["content"].startswith("[Resolved]")
        and all(word in html.unescape(json.dumps(card, ensure_ascii=False)) for word in words)
    ]


def calls_about(feishu: FakeFeishu, *words: str) -> list[str]:
    """Users rung for a message containing all ``words``."""
    return [
        user
        for message_id, user in feishu.calls
        if all(word in json.dumps(feishu.messages.get(message_id, {}), ensure_ascii=False) for word in words)
    ]


# ---- what the code exports, scraped live -----------------------------------------------------------------
def exported_names(*urls: str) -> set[str]:
    """Sample names (``x_total``, ``x_bucket``, ...) the processes at ``urls`` serve on /metrics now."""
    names: set[str] = set()
    for url in urls:
        status, body = get(f"{url}/metrics")
        assert status == 200, f"{url}/metrics: HTTP {status}"
        for family in text_string_to_metric_families(body.decode()):
            names.update(sample.name for sample in family.samples)
    return names


def grafana_expr(expr: str, rate_interval: str = "30s") -> str:
    """A panel's query as Grafana sends it, for all namespaces and jobs."""
    expr = expr.replace("$__rate_interval", rate_interval)
    return re.sub(r"\$\{?(namespace|trainingjob)\}?", ".+", expr)


def rule_and_panel_queries() -> dict[str, str]:
    """Every query the chart ships: alert and recording rules, dashboard panels and variables."""
    queries = {
        f"rule {rule.get('alert') or rule.get('record')}": rule["expr"]
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
    }
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            queries[f"panel {panel['title']!r} {target['refId']}"] = grafana_expr(target["expr"])
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            inner = re.fullmatch(r"label_values\((.+),\s*\w+\)", query["query"])
            queries[f"variable {variable['name']}"] = grafana_expr(inner.group(1) if inner else query["query"])
    return queries


def unexported(prometheus: Prometheus, queries: dict[str, str], exported: set[str]) -> dict[str, set[str]]:
    """Per query, the rankwatch metrics it reads that no scraped rankwatch process serves."""
    missing = {}
    for where, expr in queries.items():
        names = {n for n in prometheus.selectors(expr) if n.startswith("rankwatch_")} - exported
        if names:
            missing[where] = names
    return missing


# ---- tests ----------------------------------------------------------------------------------------------
def test_hung_job_pages_p0_through_prometheus_and_alertmanager_with_rankwatch_alerting_off(
    api, namespace, pod_runner, eventually, prometheus, feishu, receiver
):
    faults = {"RANKWATCH_STANDIN_FAULT_RANK": "2", "RANKWATCH_STANDIN_HANG_BEFORE_CALL": "300"}
    job = standin_job("hang", faults)
    job["spec"]["recovery"] = {"policy": "None"}  # the hang stays (no restart): the P0 is for a person
    create_job(api, namespace, job)
    eventually(lambda: diagnosed(api, namespace, "hang", "Hung"), 120, interval=1, what="Hung=True")
    assert "RANKWATCH_ALERTING_CONFIG" not in os.environ  # the operator pages nobody itself

    hung = f'rankwatch_job_condition{{namespace="{namespace}", trainingjob="hang", condition="Hung"}} == 1'
    eventually(lambda: prometheus.query(hung), 30, what="the Hung condition in Prometheus")
    alert = eventually(lambda: prometheus.firing("RankwatchJobHung", namespace=namespace), 60, what="RankwatchJobHung")
    assert alert[0]["labels"]["severity"] == "P0" and alert[0]["labels"]["trainingjob"] == "hang"

    rung = eventually(lambda: calls_about(feishu, "RankwatchJobHung", f"{namespace}/hang"), 60, what="the P0 call")
    assert sorted(set(rung)) == sorted(ONCALL), rung  # every on-call user is rung
    (card,) = eventually(lambda: cards_about(feishu, "RankwatchJobHung", f"{namespace}/hang"), 30, what="a card")
    assert card["header"]["title"]["content"].startswith("[P0] RankwatchJobHung")
    assert card["header"]["template"] == "red"
    status, body = get(f"{receiver}/alerting/alerts", token=INTAKE_TOKEN)
    taken = [a for a in json.loads(body) if a["labels"].get("alertname") == "RankwatchJobHung"]
    assert status == 200 and taken and taken[0]["source"] == "alertmanager", taken


def test_straggler_p1_carries_namespace_and_job_and_every_panel_has_data(
    api, namespace, pod_runner, eventually, prometheus, feishu, receiver, collector_url
):
    started = time.time()
    faults = STRAGGLER
    create_job(api, namespace, standin_job("slow", faults))
    eventually(lambda: diagnosed(api, namespace, "slow", "Degraded"), 120, interval=1, what="Degraded=True")

    alert = eventually(
        lambda: prometheus.firing("RankwatchJobStraggler", namespace=namespace), 60, what="RankwatchJobStraggler"
    )
    assert alert[0]["labels"] == {
        "alertname": "RankwatchJobStraggler",
        "severity": "P1",
        "component": "rankwatch",
        "namespace": namespace,
        "trainingjob": "slow",
    }
    (card,) = eventually(lambda: cards_about(feishu, "RankwatchJobStraggler", namespace), 60, what="the P1 card")
    assert card["header"]["title"]["content"] == f"[P1] RankwatchJobStraggler · {namespace}/slow"
    assert card["header"]["template"] == "orange"
    assert f"{namespace}/slow" in json.dumps(card["elements"], ensure_ascii=False)  # the card's Job field
    assert not calls_about(feishu, "RankwatchJobStraggler"), "a P1 rings nobody"

    # The dashboard as Grafana would draw it over the job's life: every panel has data from the live
    # processes (queries of third-party exporters excepted: kube-state-metrics does not run here).
    sidecar = kubernetes.client.CoreV1Api(api).read_namespaced_pod("slow-worker-1", namespace)
    sidecar_url = sidecar.metadata.annotations["rankwatch.io/sidecar-endpoint"]
    eventually(
        lambda: prometheus.query(f'rankwatch_sidecar_rings{{namespace="{namespace}", trainingjob="slow"}}'),
        30,
        what="the sidecars' series (Kubernetes SD of the pod runner's pods)",
    )
    end = time.time()
    dashboard = json.loads(DASHBOARD.read_text())
    empty = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = grafana_expr(target["expr"])
            if prometheus.selectors(expr) and all(
                n.startswith(THIRD_PARTY_PREFIXES) for n in prometheus.selectors(expr)
            ):
                continue
            if not prometheus.query_range(expr, started, end):
                empty.append(f"{panel['title']} ({target['refId']}): {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
    namespaces = prometheus.api("label/namespace/values", **{"match[]": "rankwatch_job_phase"})
    assert namespace in namespaces  # the dashboard's $namespace variable lists the job's namespace

    # No rule, recording rule, panel or variable reads a rankwatch metric the code does not export,
    # judged by scraping the running operator, sidecar and alert receiver now.
    exported = exported_names(collector_url, sidecar_url, receiver)
    assert {"rankwatch_job_condition", "rankwatch_collective_calls_total"} <= exported
    missing = unexported(prometheus, rule_and_panel_queries(), exported)
    assert not missing, f"the chart reads metrics nothing exports: {missing}"
    # ... and the check would catch one that is not exported.
    assert unexported(prometheus, {"probe": "rankwatch_job_conditions == 1"}, exported) == {
        "probe": {"rankwatch_job_conditions"}
    }


def test_infrastructure_alerts_from_alertmanager_become_cards_and_p0_calls(monitoring, prometheus, feishu, eventually):
    """Sites that route through Alertmanager keep doing so: the chart's GPU and InfiniBand rules on
    exporter series, Alertmanager, rankwatch's intake, Feishu. Node and device names are new in every
    run: an earlier run's link alert fires on for the 15 minutes of its rule's window."""
    host, device = f"gpu-node-{uuid.uuid4().hex[:6]}", f"mlx5_{uuid.uuid4().hex[:6]}"
    dcgm, node = Exporter(), Exporter()
    try:
        dcgm.text = (
            "# TYPE DCGM_FI_DEV_XID_ERRORS gauge\n"
            f'DCGM_FI_DEV_XID_ERRORS{{gpu="3",UUID="GPU-3a1f",Hostname="{host}",modelName="NVIDIA H100"}} 0\n'
        )
        node.text = (
            "# TYPE node_infiniband_link_downed_total counter\n"
            f'node_infiniband_link_downed_total{{device="{device}",port="1",instance="{host}:9100"}} 4\n'
        )
        monitoring.scrape("dcgm-exporter", [dcgm.address])
        monitoring.scrape("node-exporter", [node.address])
        eventually(lambda: prometheus.query('up{job=~"dcgm-exporter|node-exporter"} == 1'), 30, what="exporters up")
        time.sleep(3)  # a few samples before the faults
        dcgm.text = dcgm.text.replace("} 0\n", "} 79\n")  # the GPU fell off the bus
        node.text = node.text.replace("} 4\n", "} 5\n")  # the link went down once more

        rung = eventually(lambda: calls_about(feishu, "GPUFellOffBus", host), 60, what="the XID 79 call")
        assert sorted(set(rung)) == sorted(ONCALL)
        (xid,) = eventually(lambda: cards_about(feishu, "GPUFellOffBus", host), 30, what="the XID card")
        assert xid["header"]["title"]["content"] == f"[P0] GPUFellOffBus · {host}"  # the node, not the scrape job
        assert f"GPU 3 on {host} fell off the bus (XID 79)" in json.dumps(xid, ensure_ascii=False)
        links = eventually(lambda: cards_about(feishu, "InfiniBandLinkFlapping", device), 60, what="the IB card")
        assert all(card["header"]["title"]["content"].startswith("[P1] InfiniBandLinkFlapping") for card in links)
        assert not calls_about(feishu, "InfiniBandLinkFlapping"), "a P1 rings nobody"
    finally:
        dcgm.shutdown()
        node.shutdown()
