"""A generic JSON webhook: Alertmanager's webhook format (version 4), so existing tools accept it.

Storm summaries, reports and tests use the same envelope with a ``kind`` field and no ``alerts``
beyond the samples they carry.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from rankwatch.alerting import cards
from rankwatch.alerting.config import Webhook
from rankwatch.alerting.delivery import DeliveryError
from rankwatch.alerting.messages import Message, Notification, StormSummary, TestMessage, WeeklyReport
from rankwatch.alerting.model import Alert, rfc3339
from rankwatch.alerting.transport import host_of, request_json, server_error

ZERO_TIME = "0001-01-01T00:00:00Z"  # Alertmanager's endsAt for a firing alert


def alert_json(alert: Alert, now_resolved: bool) -> dict[str, Any]:
    return {
        "status": "resolved" if now_resolved else "firing",
        "labels": {**alert.labels, "level": alert.level.value},
        "annotations": dict(alert.annotations),
        "startsAt": rfc3339(alert.starts_at),
        "endsAt": rfc3339(alert.ends_at) if now_resolved and alert.ends_at is not None else ZERO_TIME,
        "generatorURL": alert.generator_url,
        "fingerprint": alert.fingerprint,
    }


def payload(message: Message) -> dict[str, Any]:
    base: dict[str, Any] = {"version": "4", "receiver": message.receiver, "title": cards.title(message)}
    if isinstance(message, Notification):
        alerts = [alert_json(a, False) for a in message.firing] + [alert_json(a, True) for a in message.resolved]
        common = _common([a["labels"] for a in alerts])
        return {
            **base,
            "kind": "notification",
            "status": message.status,
            "groupKey": message.group_key,
            "groupLabels": dict(message.group_labels),
            "commonLabels": common,
            "commonAnnotations": _common([a["annotations"] for a in alerts]),
            "truncatedAlerts": 0,
            "alerts": alerts,
        }
    if isinstance(message, StormSummary):
        return {
            **base,
            "kind": "storm_summary",
            "status": "firing",
            "windowStart": rfc3339(message.window_start),
            "windowEnd": rfc3339(message.window_end),
            "firing": len(message.firing),
            "resolved": len(message.resolved),
            "byLevel": {str(k): v for k, v in message.by_level.items()},
            "topAlerts": message.top("alertname"),
        }
    if isinstance(message, WeeklyReport):
        return {
            **base,
            "kind": "weekly_report",
            "start": rfc3339(message.start),
            "end": rfc3339(message.end),
            "counts": {str(k): v for k, v in message.counts.items()},
            "resolved": message.resolved,
            "stillFiring": message.still_firing,
            "meanTimeToResolveSeconds": message.mean_time_to_resolve,
            "top": [{"alertname": t.name, "scope": t.scope, "count": t.count, "level": t.level} for t in message.top],
        }
    assert isinstance(message, TestMessage)
    return {**base, "kind": "test", "level": message.level.value, "text": message.note}


def _common(dicts: list[dict[str, str]]) -> dict[str, str]:
    if not dicts:
        return {}
    first = dicts[0]
    return {k: v for k, v in first.items() if all(d.get(k) == v for d in dicts[1:])}


class WebhookReceiver:
    rings = False

    def __init__(self, name: str, config: Webhook) -> None:
        self.name = name
        self.config = config

    def __repr__(self) -> str:
        return (
            f"WebhookReceiver(name={self.name!r}, url={self.config.url!r}, bearer_token={self.config.bearer_token!r})"
        )

    async def send(self, message: Message, session: aiohttp.ClientSession) -> None:
        url = self.config.url.reveal()
        who = f"webhook receiver {self.name!r}"
        headers = {}
        if self.config.bearer_token is not None:
            headers["Authorization"] = f"Bearer {self.config.bearer_token.reveal()}"
        response = await request_json(session, "POST", url, who, payload(message), headers=headers)
        if response.status == 429:
            raise DeliveryError(f"{who}: rate limited (HTTP 429)", "rate_limited", True, response.retry_after())
        if response.status >= 500:
            raise server_error(who, host_of(url), response)
        if response.status in (401, 403):
            raise DeliveryError(f"{who}: HTTP {response.status}: check bearer_token", "auth", retryable=False)
        if response.status >= 300:
            raise DeliveryError(f"{who}: HTTP {response.status} from {host_of(url)}", "rejected", retryable=False)
