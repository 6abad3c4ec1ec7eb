"""Feishu interactive cards for every message kind: colour by level, green when resolved.

A card is what a person on call reads first, so each alert shows where (job, node, rank), what
(summary), why we think so (evidence) and when; Feishu's custom bot refuses bodies over 20 KB, so
long text is cut and at most ``MAX_ALERTS`` alerts are listed per card.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from rankwatch import tenant_text
from rankwatch.alerting.findings import NODE_ALERTS_ANNOTATION
from rankwatch.alerting.messages import Message, Notification, StormSummary, TestMessage, WeeklyReport
from rankwatch.alerting.model import Alert, Level, job_of, node_of, rfc3339

COLOURS = {Level.P0: "red", Level.P1: "orange", Level.P2: "yellow", Level.P3: "blue"}
RESOLVED_COLOUR = "green"
REPORT_COLOUR = "indigo"
MAX_ALERTS = 10
MAX_TEXT = 900


def colour(message: Message) -> str:
    if isinstance(message, WeeklyReport):
        return REPORT_COLOUR
    if isinstance(message, Notification) and not message.firing:
        return RESOLVED_COLOUR
    return COLOURS[message.level]


def title(message: Message) -> str:
    if isinstance(message, Notification):
        first = (message.firing or message.resolved)[0]
        where = job_of(first) or node_of(first)
        subject = first.name + (f" · {where}" if where else "")
        count = len(message.firing) if message.firing else len(message.resolved)
        more = f" (+{count - 1} more)" if count > 1 else ""
        if not message.firing:
            return _cut(f"[Resolved] [{message.level}] {subject}{more}", 200)
        return _cut(f"[{message.level}] {subject}{more}", 200)
    if isinstance(message, StormSummary):
        return (
            f"[{message.level}] Alert storm: {len(message.firing)} firing, {len(message.resolved)} resolved "
            f"in {_duration(message.window_end - message.window_start)}"
        )
    if isinstance(message, WeeklyReport):
        return f"Weekly alert report {rfc3339(message.start)[:10]} – {rfc3339(message.end)[:10]}"
    return f"[{message.level}] rankwatch test notification"


def card(message: Message, mentions: Iterable[str] = ()) -> dict[str, Any]:
    """The ``card`` object of an ``interactive`` message (custom bot and Open Platform alike)."""
    if isinstance(message, Notification):
        elements = _notification_elements(message)
    elif isinstance(message, StormSummary):
        elements = _storm_elements(message)
    elif isinstance(message, WeeklyReport):
        elements = _report_elements(message)
    else:
        elements = _test_elements(message)
    mentions = list(mentions)
    firing = isinstance(message, StormSummary | TestMessage) or (
        isinstance(message, Notification) and bool(message.firing)
    )
    if mentions and firing:
        elements.append(_markdown(" ".join(_mention(user) for user in mentions)))
    return {
        "config": {"wide_screen_mode": True},
        "header": {"template": colour(message), "title": {"tag": "plain_text", "content": title(message)}},
        "elements": elements,
    }


def plain_text(message: Message) -> str:
    """One paragraph for a phone call's message: what and where, no markup."""
    lines = [title(message)]
    if isinstance(message, Notification):
        for alert in message.firing[:3]:
            lines.append(f"{_where(alert)}: {summary_of(alert)}".strip(": "))
    return _cut("\n".join(lines), 2000)


# -- notification -------------------------------------------------------------------------------


def _notification_elements(message: Notification) -> list[dict[str, Any]]:
    elements: list[dict[str, Any]] = []
    if message.firing:
        elements += _alert_list(message.firing, resolved=False)
    if message.resolved:
        if message.firing:
            elements += [{"tag": "hr"}, _markdown(f"**Resolved ({len(message.resolved)})**")]
        elements += _alert_list(message.resolved, resolved=True)
    note = f"rankwatch · {message.receiver} · group {message.group_key}"
    if message.repeat:
        note += " · still firing (repeat)"
    elements.append({"tag": "note", "elements": [{"tag": "plain_text", "content": note}]})
    return elements


def _alert_list(alerts: tuple[Alert, ...], resolved: bool) -> list[dict[str, Any]]:
    elements: list[dict[str, Any]] = []
    for index, alert in enumerate(alerts[:MAX_ALERTS]):
        if index:
            elements.append({"tag": "hr"})
        elements += _alert_elements(alert, resolved)
    if len(alerts) > MAX_ALERTS:
        elements.append(_markdown(f"… and {len(alerts) - MAX_ALERTS} more"))
    return elements


def _alert_elements(alert: Alert, resolved: bool) -> list[dict[str, Any]]:
    fields = [("Job", job_of(alert) or "—"), ("Node", node_of(alert) or "—"), ("Rank", alert.labels.get("rank") or "—")]
    fields.append(("Level", alert.level.value))
    elements: list[dict[str, Any]] = [
        {
            "tag": "div",
            "fields": [
                {"is_short": True, "text": {"tag": "lark_md", "content": f"**{name}**\n{_escape(value)}"}}
                for name, value in fields
            ],
        },
        _markdown(f"**Summary**\n{_escape(summary_of(alert))}"),
    ]
    if alert.annotations.get("cause"):
        elements.append(_markdown(f"**Cause**\n{_escape(_cut(alert.annotations['cause'], MAX_TEXT))}"))
    if alert.annotations.get(NODE_ALERTS_ANNOTATION):
        text = _cut(alert.annotations[NODE_ALERTS_ANNOTATION], MAX_TEXT)
        elements.append(_markdown(f"**Firing on its node**\n{_escape(text)}"))
    evidence = evidence_of(alert)
    if evidence:
        elements.append(_markdown(f"**Evidence**\n{_escape(evidence)}"))
    when = f"**Started** {rfc3339(alert.starts_at)}"
    if resolved and alert.ends_at is not None:
        when += f"   **Resolved** {rfc3339(alert.ends_at)} (after {_duration(alert.ends_at - alert.starts_at)})"
    elements.append(_markdown(when))
    links = [(name, url) for name, url in _links(alert) if url.startswith(("http://", "https://"))]
    if links:
        elements.append(
            {
                "tag": "action",
                "actions": [
                    {"tag": "button", "text": {"tag": "plain_text", "content": name}, "type": "default", "url": url}
                    for name, url in links[:3]
                ],
            }
        )
    return elements


def summary_of(alert: Alert) -> str:
    annotations = alert.annotations
    return annotations.get("summary") or annotations.get("description") or annotations.get("message") or alert.name


def evidence_of(alert: Alert) -> str:
    """The numbers behind an alert: a finding's evidence (JSON), else a Prometheus description."""
    annotations = alert.annotations
    raw = annotations.get("evidence", "")
    if raw:
        try:
            data = json.loads(raw)
        except json.JSONDecodeError:
            return _cut(raw, MAX_TEXT)
        if isinstance(data, Mapping):
            lines = [f"{key}: {_compact(value)}" for key, value in list(data.items())[:12]]
            return _cut("\n".join(lines), MAX_TEXT)
        return _cut(_compact(data), MAX_TEXT)
    if annotations.get("summary") and annotations.get("description"):
        return _cut(annotations["description"], MAX_TEXT)
    return ""


def _links(alert: Alert) -> list[tuple[str, str]]:
    links = [("Source", alert.generator_url)] if alert.generator_url else []
    for name in ("runbook_url", "dashboard_url", "report_url"):
        if alert.annotations.get(name):
            links.append((name.removesuffix("_url").capitalize(), alert.annotations[name]))
    return links


def _where(alert: Alert) -> str:
    parts = [job_of(alert), node_of(alert)]
    if alert.labels.get("rank"):
        parts.append(f"rank {alert.labels['rank']}")
    return " ".join(part for part in parts if part)


# -- storm, report, test ------------------------------------------------------------------------


def _storm_elements(summary: StormSummary) -> list[dict[str, Any]]:
    counts = " · ".join(f"{level}: {count}" for level, count in summary.by_level.items())
    elements = [
        _markdown(
            f"**{len(summary.notifications)} notifications held back** to avoid flooding this chat "
            f"({len(summary.firing)} alerts firing, {len(summary.resolved)} resolved).\n**By level** {counts}"
        )
    ]
    for label, heading in (("alertname", "Top alerts"), ("node", "Top nodes"), ("trainingjob", "Top jobs")):
        top = summary.top(label)
        if top:
            elements.append(_markdown(f"**{heading}**\n" + "\n".join(f"{_escape(v)}: {n}" for v, n in top)))
    samples = [a for a in summary.firing if a.level == summary.level][:3]
    for alert in samples:
        elements.append(_markdown(f"• {_escape(_where(alert) or alert.name)}: {_escape(summary_of(alert))}"))
    window = f"{rfc3339(summary.window_start)} – {rfc3339(summary.window_end)}"
    elements.append({"tag": "note", "elements": [{"tag": "plain_text", "content": f"storm window {window}"}]})
    return elements


def _report_elements(report: WeeklyReport) -> list[dict[str, Any]]:
    mttr = _duration(report.mean_time_to_resolve) if report.mean_time_to_resolve is not None else "—"
    fields = [(f"{level}", str(report.counts.get(level, 0))) for level in Level]
    fields += [("Resolved", str(report.resolved)), ("Still firing", str(report.still_firing)), ("MTTR", mttr)]
    elements: list[dict[str, Any]] = [
        _markdown(f"**{report.total} alerts** this week"),
        {
            "tag": "div",
            "fields": [
                {"is_short": True, "text": {"tag": "lark_md", "content": f"**{name}**\n{value}"}}
                for name, value in fields
            ],
        },
    ]
    if report.top:
        lines = [
            f"{i}. [{top.level}] {_escape(top.name)}{' · ' + _escape(top.scope) if top.scope else ''}: {top.count}×"
            for i, top in enumerate(report.top, 1)
        ]
        elements += [{"tag": "hr"}, _markdown("**Top alerts**\n" + "\n".join(lines))]
    elements.append(
        {
            "tag": "note",
            "elements": [{"tag": "plain_text", "content": "MTTR: mean time to resolve, over resolved alerts"}],
        }
    )
    return elements


def _test_elements(message: TestMessage) -> list[dict[str, Any]]:
    return [
        _markdown(_escape(message.note)),
        {"tag": "note", "elements": [{"tag": "plain_text", "content": f"sent {rfc3339(message.sent_at)}"}]},
    ]


# -- helpers ------------------------------------------------------------------------------------


def _markdown(content: str) -> dict[str, Any]:
    return {"tag": "div", "text": {"tag": "lark_md", "content": content}}


def _mention(user: str) -> str:
    return "<at id=all></at>" if user == "all" else f'<at user_id="{_escape(user)}"></at>'


def _escape(text: str) -> str:
    # lark_md treats much of an alert's text as markup (a job's frame names, its pod names); it is data.
    return tenant_text.lark_md(text, MAX_TEXT)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _compact(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and len(value) > 8:
        return json.dumps(value[:8])[:-1] + f", … ({len(value)} in all)]"
    return value if isinstance(value, str) else json.dumps(value, separators=(", ", ": "))


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"
