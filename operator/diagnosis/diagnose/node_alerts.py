"""The suspect node's firing infrastructure alerts, read from the cluster's Prometheus or Alertmanager.

A rank is slow or hung; the person paged next asks whether its GPU is throttled, failing or off the
bus. Those answers already exist as alerts (the chart's GPU, node and InfiniBand rules, or a site's
own), firing in a Prometheus nobody thinks to open. The diagnosis reads them for the nodes it names
and attaches them: ``GPUClocksThrottled (P2) on gpu-node-3 since 12:01:07Z: GPU 3 ... hw_thermal_slowdown``.

Which alerts: firing (Prometheus ``state: firing``; Alertmanager active, neither silenced nor
inhibited) and about a named node: one of the labels ``node``, ``Hostname`` (dcgm-exporter),
``kubernetes_node``, ``nodename`` or ``instance`` (its host part) is the node's name. Alerts about a
training job (a ``trainingjob`` label, or ``component: rankwatch``) are rankwatch's own findings,
not the node's, and are left out.

Reading them never fails a diagnosis: an unreachable source, an HTTP error, a body over
``MAX_ANSWER_BYTES`` or one that is not what the API documents becomes a problem on the diagnosis,
naming the URL. The answer is read up to that cap only, and parsed in a worker thread: a huge alert
list does not stall the operator's event loop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from rankwatch import tenant_text
from rankwatch.model.evidence import NodeAlertEvidence
from rankwatch.operator.config import NodeAlertSources

NODE_LABELS = ("node", "Hostname", "kubernetes_node", "nodename", "instance")
"""Labels that name the node an alert is about, as the common exporters and relabellings spell it."""
MAX_ALERTS = 16
"""At most this many alerts are attached (most severe first): a dying node can fire dozens."""
MAX_ANSWER_BYTES = 8 << 20
"""An alerts answer larger than this is refused (thousands of alerts are a few MiB)."""
MAX_TEXT = 500
"""An alert's name and summary are cut to this (they go into status, Events and cards)."""
PROMETHEUS_ALERTS_PATH = "/api/v1/alerts"
ALERTMANAGER_ALERTS_PATH = "/api/v2/alerts"


@dataclass(frozen=True)
class NodeAlert:
    """One firing alert about a node, as the diagnosis shows it."""

    name: str
    node: str
    severity: str
    summary: str
    since: str  # when it started firing (RFC 3339, as the source gave it)
    source: str  # "prometheus" or "alertmanager"

    @property
    def text(self) -> str:
        level = f" ({self.severity})" if self.severity else ""
        since = f" since {self.since}" if self.since else ""
        return f"{self.name}{level} on {self.node}{since}" + (f": {self.summary}" if self.summary else "")

    def to_json(self) -> dict[str, str]:
        return asdict(self)

    def as_evidence(self) -> NodeAlertEvidence:
        """The entry of a finding's ``evidence[NODE_ALERTS]``."""
        return NodeAlertEvidence(**asdict(self), text=self.text)


def node_of(labels: dict[str, str], nodes: set[str]) -> str | None:
    """The node among ``nodes`` an alert's labels name, or None."""
    for label in NODE_LABELS:
        value = labels.get(label)
        if not value:
            continue
        if label == "instance":
            value = value.rsplit(":", 1)[0] if value.count(":") == 1 else value
        if value in nodes:
            return value
    return None


def _about_a_job(labels: dict[str, str]) -> bool:
    return bool(labels.get("trainingjob")) or labels.get("component") == "rankwatch"


def _alert(labels: dict[str, str], annotations: dict[str, str], since: str, source: str, node: str) -> NodeAlert:
    return NodeAlert(
        name=tenant_text.one_line(labels.get("alertname", "(no alertname)"), MAX_TEXT),
        node=node,
        severity=tenant_text.one_line(labels.get("severity", ""), MAX_TEXT),
        summary=tenant_text.one_line(
            " ".join((annotations.get("summary") or annotations.get("description") or "").split()), MAX_TEXT
        ),
        since=tenant_text.one_line(since, 64),
        source=source,
    )


def from_prometheus(document: Any, nodes: set[str]) -> list[NodeAlert]:
    """Firing alerts about ``nodes`` in a Prometheus ``/api/v1/alerts`` answer; ValueError when the
    document is not one."""
    try:
        alerts = document["data"]["alerts"]
        if document.get("status") != "success" or not isinstance(alerts, list):
            raise TypeError
    except (KeyError, TypeError, AttributeError):
        raise ValueError("not a Prometheus alerts answer (expected {status: success, data: {alerts: [...]}})") from None
    found = []
    for alert in alerts:
        labels = _strings(alert.get("labels")) if isinstance(alert, dict) else {}
        node = node_of(labels, nodes)
        if node is None or alert.get("state") != "firing" or _about_a_job(labels):
            continue
        found.append(_alert(labels, _strings(alert.get("annotations")), str(alert.get("activeAt") or ""),
                            "prometheus", node))  # fmt: skip
    return found


def from_alertmanager(document: Any, nodes: set[str]) -> list[NodeAlert]:
    """Active, neither silenced nor inhibited alerts about ``nodes`` in an Alertmanager ``/api/v2/alerts``
    answer; ValueError when the document is not one."""
    if not isinstance(document, list):
        raise ValueError("not an Alertmanager alerts answer (expected a list of alerts)")
    found = []
    for alert in document:
        if not isinstance(alert, dict):
            raise ValueError("not an Alertmanager alerts answer (an alert is not an object)")
        labels = _strings(alert.get("labels"))
        node = node_of(labels, nodes)
        state = (alert.get("status") or {}).get("state") if isinstance(alert.get("status"), dict) else None
        if node is None or state != "active" or _about_a_job(labels):
            continue
        found.append(_alert(labels, _strings(alert.get("annotations")), str(alert.get("startsAt") or ""),
                            "alertmanager", node))  # fmt: skip
    return found


def _strings(value: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


def _level(alert: NodeAlert) -> tuple[str, str, str]:
    # P0 before P3, unlevelled last; then by node and name for a stable order
    return (alert.severity if alert.severity.startswith("P") else "P9", alert.node, alert.name)


async def firing_on(nodes: Iterable[str], sources: NodeAlertSources) -> tuple[list[NodeAlert], list[str]]:
    """(the alerts firing on ``nodes``, most severe first, one per name and node and source labels;
    the problems of reading them). Never raises for a source's trouble."""
    wanted = {node for node in nodes if node}
    if not wanted or not sources.configured:
        return [], []
    timeout = aiohttp.ClientTimeout(total=sources.timeout_seconds)
    reads = []
    if sources.prometheus_url:
        reads.append(("Prometheus", sources.prometheus_url + PROMETHEUS_ALERTS_PATH, {}, from_prometheus))
    if sources.alertmanager_url:
        params = {"active": "true", "silenced": "false", "inhibited": "false"}
        reads.append(("Alertmanager", sources.alertmanager_url + ALERTMANAGER_ALERTS_PATH, params, from_alertmanager))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        results = await asyncio.gather(*(_read(session, what, url, params, parse, wanted)
                                         for what, url, params, parse in reads))  # fmt: skip
    alerts: dict[tuple[str, str, str], NodeAlert] = {}
    problems: list[str] = []
    for found, problem in results:
        if problem:
            problems.append(problem)
        for alert in found:  # the same alert from Prometheus and from Alertmanager is shown once
            alerts.setdefault((alert.name, alert.node, alert.summary), alert)
    ordered = sorted(alerts.values(), key=_level)
    if len(ordered) > MAX_ALERTS:
        problems.append(
            f"{len(ordered)} alerts fire on {', '.join(sorted(wanted))}; the {MAX_ALERTS} most severe are shown"
        )
    return ordered[:MAX_ALERTS], problems


async def _read(
    session: aiohttp.ClientSession, what: str, url: str, params: dict[str, str], parse: Any, nodes: set[str]
) -> tuple[list[NodeAlert], str | None]:
    missing = (
        f"; the alerts of node{'s' if len(nodes) > 1 else ''} {', '.join(sorted(nodes))} are not on this diagnosis"
    )
    try:
        async with session.get(url, params=params, headers={"Accept": "application/json"}) as response:
            if response.status != 200:
                return [], f"{what} at {url} answered HTTP {response.status}{missing}"
            body = bytearray()
            async for chunk in response.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    too_large = f"more than {MAX_ANSWER_BYTES >> 20} MiB: not read"
                    return [], f"{what} at {url} answered with {too_large}{missing}"
    except (aiohttp.ClientError, TimeoutError, OSError) as error:
        return [], f"{what} at {url} unreachable ({error or type(error).__name__}){missing}"
    return await asyncio.to_thread(_parsed, what, url, body, parse, nodes, missing)


def _parsed(
    what: str, url: str, body: bytes | bytearray, parse: Any, nodes: set[str], missing: str
) -> tuple[list[NodeAlert], str | None]:
    """The alerts in an answer's ``body`` (blocking: a few MiB of JSON take a while), or the problem."""
    try:
        document = json.loads(body)
    except ValueError:
        return [], f"{what} at {url} answered with a body that is not JSON{missing}"
    try:
        return parse(document, nodes), None
    except ValueError as error:
        return [], f"{what} at {url}: {error}{missing}"
