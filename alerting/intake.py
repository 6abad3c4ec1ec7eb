"""HTTP intake: Alertmanager's webhook (so the cluster's Prometheus alerts take our routes), silences,
the report and test messages on demand. Mount on the operator's aiohttp app with ``add_routes``.

Alertmanager's level is its ``severity`` label: ``P0``..``P3`` as they are, Prometheus' usual
``critical`` / ``warning`` / ``info`` mapped to P1 / P2 / P3 (only an explicit P0 rings phones;
``intake.severity_levels`` changes the mapping), no severity: ``intake.default_level`` (P3).
"""

from __future__ import annotations

import datetime
import hmac
import logging
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from rankwatch.alerting.config import IntakeConfig, parse_duration
from rankwatch.alerting.delivery import DeliveryError
from rankwatch.alerting.matchers import MatcherError
from rankwatch.alerting.model import Alert, Level, parse_rfc3339, rfc3339
from rankwatch.alerting.pipeline import AlertPipeline

log = logging.getLogger(__name__)

PREFIX = "/alerting"
PIPELINE_KEY = web.AppKey("rankwatch_alert_pipeline", AlertPipeline)
ZERO_TIME_PREFIX = "0001-01-01"


class IntakeError(ValueError):
    """A payload we cannot take; the message says which alert and field (answered as HTTP 400)."""


def level_of(labels: Mapping[str, str], intake: IntakeConfig) -> Level:
    severity = labels.get("severity", "").strip()
    if not severity:
        return intake.default_level
    try:
        return Level.parse(severity)
    except ValueError:
        return intake.severity_levels.get(severity.lower(), intake.default_level)


def alerts_from_alertmanager(payload: Any, intake: IntakeConfig, now: float) -> list[Alert]:
    """Alertmanager webhook payload (version 4) -> alerts; resolved ones carry their ``endsAt``."""
    if not isinstance(payload, Mapping):
        raise IntakeError("expected a JSON object (Alertmanager webhook payload)")
    if str(payload.get("version", "")) != "4":
        raise IntakeError(f"unsupported payload version {payload.get('version')!r}: Alertmanager sends version 4")
    items = payload.get("alerts")
    if not isinstance(items, list):
        raise IntakeError("alerts: expected a list")
    alerts = []
    for index, item in enumerate(items):
        where = f"alerts[{index}]"
        if not isinstance(item, Mapping):
            raise IntakeError(f"{where}: expected an object")
        labels = item.get("labels")
        if not isinstance(labels, Mapping) or not labels:
            raise IntakeError(f"{where}.labels: expected a non-empty object")
        annotations = item.get("annotations") or {}
        if not isinstance(annotations, Mapping):
            raise IntakeError(f"{where}.annotations: expected an object")
        labels = {str(k): str(v) for k, v in labels.items()}
        starts_at = _time(item.get("startsAt"), f"{where}.startsAt") or now
        ends_at = _time(item.get("endsAt"), f"{where}.endsAt")
        if item.get("status") == "resolved":
            ends_at = min(ends_at or now, now)
        elif ends_at is not None and ends_at <= now:
            ends_at = None  # firing says firing; a past endsAt here is Alertmanager's resolve_timeout guess
        alerts.append(
            Alert(
                labels=labels,
                level=level_of(labels, intake),
                starts_at=starts_at,
                ends_at=ends_at,
                annotations={str(k): str(v) for k, v in annotations.items()},
                generator_url=str(item.get("generatorURL") or ""),
                source="alertmanager",
            )
        )
    return alerts


def _time(value: Any, where: str) -> float | None:
    if value in (None, "") or str(value).startswith(ZERO_TIME_PREFIX):
        return None
    text = str(value)
    # Go prints nanoseconds; Python parses at most microseconds.
    if "." in text:
        head, _, rest = text.partition(".")
        digits = len(rest) - len(rest.lstrip("0123456789"))
        text = f"{head}.{rest[: min(digits, 6)]}{rest[digits:]}"
    try:
        return parse_rfc3339(text)
    except ValueError:
        raise IntakeError(f"{where}: {value!r} is not an RFC 3339 time") from None


# -- HTTP ---------------------------------------------------------------------------------------


def add_routes(app: web.Application, pipeline: AlertPipeline, prefix: str = PREFIX) -> None:
    """Register the intake on ``app`` (the operator's own server, or ``serve``'s)."""
    app[PIPELINE_KEY] = pipeline
    app.router.add_post(f"{prefix}/alertmanager", _alertmanager)
    app.router.add_get(f"{prefix}/alerts", _list_alerts)
    app.router.add_get(f"{prefix}/silences", _list_silences)
    app.router.add_post(f"{prefix}/silences", _add_silence)
    app.router.add_delete(f"{prefix}/silences/{{id}}", _expire_silence)
    app.router.add_post(f"{prefix}/report", _report)
    app.router.add_post(f"{prefix}/test", _test)


async def serve(pipeline: AlertPipeline, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, int]:
    """A server with only the intake (tests, or alerting without the rest of the operator)."""
    app = web.Application()
    add_routes(app, pipeline)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, bound


def _authorised(request: web.Request) -> None:
    """Every intake endpoint wants the bearer token; without one configured the intake is closed (it
    accepts alerts, silences and reports: nobody may use it anonymously)."""
    token = request.app[PIPELINE_KEY].config.intake.bearer_token
    if token is None:
        raise web.HTTPUnauthorized(
            text="the intake is closed: the alerting config sets no intake.bearer_token (a secretKeyRef)\n"
        )
    given = request.headers.get("Authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token.reveal()}".encode()):
        raise web.HTTPUnauthorized(text="missing or wrong bearer token\n")


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise web.HTTPBadRequest(text="body is not JSON\n") from None


async def _alertmanager(request: web.Request) -> web.Response:
    _authorised(request)
    pipeline = request.app[PIPELINE_KEY]
    try:
        alerts = alerts_from_alertmanager(await _json(request), pipeline.config.intake, pipeline._clock())
    except IntakeError as error:
        log.warning("Alertmanager webhook refused: %s", error)
        raise web.HTTPBadRequest(text=f"{error}\n") from None
    await pipeline.submit(alerts)  # stored before we answer: Alertmanager does not resend on 200
    return web.json_response({"status": "ok", "received": len(alerts)})


async def _list_alerts(request: web.Request) -> web.Response:
    _authorised(request)
    pipeline = request.app[PIPELINE_KEY]
    return web.json_response(
        [
            {**a.to_json(), "fingerprint": a.fingerprint, "startsAt": rfc3339(a.starts_at)}
            for a in pipeline.active_alerts()
        ]
    )


async def _list_silences(request: web.Request) -> web.Response:
    _authorised(request)
    pipeline = request.app[PIPELINE_KEY]
    now = pipeline._clock()
    return web.json_response([silence.to_json(now) for silence in pipeline.silences()])


SILENCE_BODY = (
    "expected {matchers: [...], duration: '2h' | endsAt: RFC 3339, startsAt: RFC 3339 (default now), "
    "createdBy, comment}"
)


def silence_window(body: Mapping[str, Any], now: float) -> tuple[float, float]:
    """(starts_at, ends_at) of a silence request: ``startsAt`` (default now), then ``endsAt`` or ``duration``
    counted from the start. Raises ValueError naming the field and what to write."""
    starts_at = _silence_time(body, "startsAt") if body.get("startsAt") else now
    if body.get("endsAt"):
        ends_at = _silence_time(body, "endsAt")
    else:
        duration = body.get("duration")
        if duration in (None, ""):
            raise ValueError("give duration (e.g. 2h) or endsAt")
        try:
            seconds = parse_duration(duration)
        except ValueError:
            raise ValueError(f"duration {duration!r} is not a duration (write e.g. 30m, 2h, 1h30m, 7d)") from None
        if seconds <= 0:
            raise ValueError(f"duration {duration!r} must be positive")
        ends_at = starts_at + seconds
    if ends_at <= now:
        raise ValueError(f"it would end at {rfc3339(ends_at)}, in the past")
    return starts_at, ends_at


def _silence_time(body: Mapping[str, Any], field: str) -> float:
    text = str(body[field])
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{field} {text!r} is not an RFC 3339 time (write e.g. 2026-12-01T08:00:00Z)") from None
    if moment.tzinfo is None:
        raise ValueError(f"{field} {text!r} has no time zone (write e.g. 2026-12-01T08:00:00Z)")
    return moment.timestamp()


async def _add_silence(request: web.Request) -> web.Response:
    _authorised(request)
    pipeline = request.app[PIPELINE_KEY]
    body = await _json(request)
    if not isinstance(body, Mapping):
        raise web.HTTPBadRequest(text=f"{SILENCE_BODY}\n")
    try:
        starts_at, ends_at = silence_window(body, pipeline._clock())
        silence = pipeline.add_silence(
            body.get("matchers") or [],
            ends_at,
            str(body.get("createdBy", "")),
            str(body.get("comment", "")),
            starts_at=starts_at,
        )
    except (MatcherError, ValueError) as error:
        raise web.HTTPBadRequest(text=f"silence: {error}\n") from None
    return web.json_response(silence.to_json(pipeline._clock()), status=201)


async def _expire_silence(request: web.Request) -> web.Response:
    _authorised(request)
    if not request.app[PIPELINE_KEY].expire_silence(request.match_info["id"]):
        raise web.HTTPNotFound(text="no such silence\n")
    return web.json_response({"status": "expired"})


async def _report(request: web.Request) -> web.Response:
    _authorised(request)
    pipeline = request.app[PIPELINE_KEY]
    receiver = request.query.get("receiver")
    try:
        report = await pipeline.send_report(receiver)
    except ValueError as error:
        raise web.HTTPBadRequest(text=f"{error}\n") from None
    except DeliveryError as error:
        raise web.HTTPBadGateway(text=f"{error}\n") from None
    return web.json_response({"status": "sent", "receiver": report.receiver, "alerts": report.total})


async def _test(request: web.Request) -> web.Response:
    _authorised(request)
    pipeline = request.app[PIPELINE_KEY]
    try:
        level = Level.parse(request.query.get("level", "P3"))
        await pipeline.send_test(request.query.get("receiver", ""), level)
    except ValueError as error:
        raise web.HTTPBadRequest(text=f"{error}\n") from None
    except DeliveryError as error:
        raise web.HTTPBadGateway(text=f"{error}\n") from None
    return web.json_response({"status": "sent"})
