"""The alerting config (YAML, from a ConfigMap), parsed into typed structures and validated at load.

Every error names the path of the bad field and what would be valid, e.g.
``route.routes[1].group_wait: '5x' is not a duration (write e.g. 30s, 5m, 4h)``; unknown fields are
refused, not ignored, so a typo (``recevier``) fails the load instead of silently dropping a page.
Credentials are references to Kubernetes Secrets, resolved here through the given resolver.
"""

from __future__ import annotations

import re
import zoneinfo
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from rankwatch.alerting.matchers import Matcher, MatcherError
from rankwatch.alerting.model import Level, parse_rfc3339
from rankwatch.alerting.secrets import Secret, SecretResolver
from rankwatch.config_error import ConfigError

DEFAULT_GROUP_BY = ("alertname", "namespace", "trainingjob")
ALL_LABELS = "..."
DEFAULT_SEVERITY_LEVELS = {"critical": Level.P1, "error": Level.P1, "warning": Level.P2, "info": Level.P3}
"""Prometheus severities that are not P-levels. ``critical`` is P1, not P0: only an explicit P0 rings phones."""
WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")


@dataclass(frozen=True)
class FeishuBot:
    """A Feishu custom bot in a group chat: interactive cards, signed when ``secret`` is set."""

    webhook_url: Secret
    secret: Secret | None = None
    mentions: tuple[str, ...] = ()
    """User ids to @mention on firing cards (``all`` mentions everyone)."""


@dataclass(frozen=True)
class FeishuPhone:
    """Feishu Open Platform app: a message to each user, then an urgent phone call to each."""

    app_id: Secret
    app_secret: Secret
    user_ids: tuple[str, ...]
    base_url: str = "https://open.feishu.cn"
    user_id_type: str = "user_id"


@dataclass(frozen=True)
class Webhook:
    """Any HTTP endpoint taking Alertmanager's webhook JSON (version 4)."""

    url: Secret
    bearer_token: Secret | None = None


@dataclass(frozen=True)
class ReceiverConfig:
    name: str
    integration: FeishuBot | FeishuPhone | Webhook
    send_resolved: bool = True


@dataclass(frozen=True)
class RouteConfig:
    receiver: str
    path: str
    """Where it is in the config (``route.routes[0]``): part of group keys, and of error messages."""
    matchers: tuple[Matcher, ...] = ()
    group_by: tuple[str, ...] = DEFAULT_GROUP_BY
    group_wait: float = 30.0
    group_interval: float = 300.0
    repeat_interval: float = 4 * 3600.0
    continue_: bool = False
    routes: tuple[RouteConfig, ...] = ()


@dataclass(frozen=True)
class InhibitRule:
    """A firing alert matching ``source`` mutes alerts matching ``target`` that agree on ``equal`` labels."""

    source_matchers: tuple[Matcher, ...]
    target_matchers: tuple[Matcher, ...]
    equal: tuple[str, ...] = ()


@dataclass(frozen=True)
class SilenceConfig:
    matchers: tuple[Matcher, ...]
    ends_at: float
    starts_at: float = 0.0
    created_by: str = "config"
    comment: str = ""


@dataclass(frozen=True)
class StormConfig:
    """Beyond ``max_alerts`` alerts to one receiver within ``window``, the rest become one summary card."""

    max_alerts: int = 50
    window: float = 300.0


@dataclass(frozen=True)
class DeliveryConfig:
    timeout: float = 10.0
    attempts: int = 5
    backoff: float = 1.0
    max_backoff: float = 60.0
    concurrency: int = 4
    """Requests in flight per receiver: a storm does not open hundreds of connections to Feishu."""
    pause_after_config_error: float = 300.0
    """After a rejected signature or credential, the receiver is not tried again for this long."""


@dataclass(frozen=True)
class ReportConfig:
    receiver: str | None = None
    """Without a receiver there is no scheduled report (``rankwatch alerts report`` still works)."""
    weekday: int = 0
    hour: int = 9
    minute: int = 0
    timezone: str = "UTC"
    top: int = 5


@dataclass(frozen=True)
class IntakeConfig:
    bearer_token: Secret | None = None
    severity_levels: Mapping[str, Level] = field(default_factory=lambda: dict(DEFAULT_SEVERITY_LEVELS))
    default_level: Level = Level.P3


@dataclass(frozen=True)
class StoreConfig:
    config_map: str = "rankwatch-alerts"
    """ConfigMaps in the operator's namespace (every replica reaches them; see ``cluster_store.py``)."""
    path: str | None = None
    """A SQLite file instead (one process: the CLI, tests, a single replica with a volume)."""
    retention: float = 90 * 86400.0
    """History older than this is deleted (the weekly report needs only a week)."""


@dataclass(frozen=True)
class AlertingConfig:
    receivers: Mapping[str, ReceiverConfig]
    route: RouteConfig
    inhibit_rules: tuple[InhibitRule, ...] = ()
    silences: tuple[SilenceConfig, ...] = ()
    storm: StormConfig = field(default_factory=StormConfig)
    delivery: DeliveryConfig = field(default_factory=DeliveryConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    intake: IntakeConfig = field(default_factory=IntakeConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    evaluation_interval: float = 1.0
    """How often groups are checked for a due notification; bounds the timing error of every interval."""


def load_config(source: str | Path, secrets: SecretResolver) -> AlertingConfig:
    """Parse YAML text (or a file path) into a validated config; resolve Secret references with ``secrets``."""
    if isinstance(source, Path):
        try:
            text = source.read_text()
        except OSError as error:
            raise ConfigError(f"{source}: {error.strerror}") from None
    else:
        text = source
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"not valid YAML: {error}") from None
    return parse_config(data, secrets)


def parse_config(data: Any, secrets: SecretResolver) -> AlertingConfig:
    top = _mapping(
        data,
        "config",
        {
            "receivers",
            "route",
            "inhibit_rules",
            "silences",
            "storm",
            "delivery",
            "report",
            "intake",
            "store",
            "evaluation_interval",
        },
        required={"receivers", "route"},
    )
    receivers: dict[str, ReceiverConfig] = {}
    for index, item in enumerate(_list(top["receivers"], "receivers")):
        receiver = _receiver(item, f"receivers[{index}]", secrets)
        if receiver.name in receivers:
            raise ConfigError(f"receivers[{index}].name: {receiver.name!r} is defined twice")
        receivers[receiver.name] = receiver
    if not receivers:
        raise ConfigError("receivers: define at least one receiver")
    route = _route(top["route"], "route", None, receivers)
    config = AlertingConfig(
        receivers=receivers,
        route=route,
        inhibit_rules=tuple(
            _inhibit_rule(item, f"inhibit_rules[{i}]")
            for i, item in enumerate(_list(top.get("inhibit_rules"), "inhibit_rules"))
        ),
        silences=tuple(
            _silence(item, f"silences[{i}]") for i, item in enumerate(_list(top.get("silences"), "silences"))
        ),
        storm=_storm(top.get("storm", {})),
        delivery=_delivery(top.get("delivery", {})),
        report=_report(top.get("report", {}), receivers),
        intake=_intake(top.get("intake", {}), secrets),
        store=_store(top.get("store", {})),
        evaluation_interval=_duration(top.get("evaluation_interval", 1.0), "evaluation_interval", positive=True),
    )
    return config


# -- receivers ----------------------------------------------------------------------------------


def _receiver(data: Any, path: str, secrets: SecretResolver) -> ReceiverConfig:
    entry = _mapping(data, path, {"name", "feishu", "feishu_phone", "webhook", "send_resolved"}, required={"name"})
    name = _string(entry["name"], f"{path}.name")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", name):
        raise ConfigError(f"{path}.name: {name!r} must be 1-63 letters, digits, '-', '_' or '.'")
    kinds = [kind for kind in ("feishu", "feishu_phone", "webhook") if kind in entry]
    if len(kinds) != 1:
        raise ConfigError(f"{path} ({name}): give exactly one of feishu, feishu_phone, webhook (got {kinds or 'none'})")
    kind = kinds[0]
    sub = f"{path}.{kind}"
    integration: FeishuBot | FeishuPhone | Webhook
    if kind == "feishu":
        body = _mapping(entry[kind], sub, {"webhook_url", "secret", "mentions"}, required={"webhook_url"})
        integration = FeishuBot(
            webhook_url=_secret(body["webhook_url"], f"{sub}.webhook_url", secrets, plain_ok=False),
            secret=_secret(body["secret"], f"{sub}.secret", secrets, plain_ok=False) if "secret" in body else None,
            mentions=_strings(body.get("mentions", []), f"{sub}.mentions"),
        )
        _check_url(integration.webhook_url, f"{sub}.webhook_url")
    elif kind == "feishu_phone":
        body = _mapping(
            entry[kind],
            sub,
            {"app_id", "app_secret", "user_ids", "base_url", "user_id_type"},
            required={"app_id", "app_secret", "user_ids"},
        )
        user_ids = _strings(body["user_ids"], f"{sub}.user_ids")
        if not user_ids:
            raise ConfigError(f"{sub}.user_ids: list at least one user to call")
        user_id_type = _string(body.get("user_id_type", "user_id"), f"{sub}.user_id_type")
        if user_id_type not in ("user_id", "open_id", "union_id"):
            raise ConfigError(f"{sub}.user_id_type: {user_id_type!r} is not one of user_id, open_id, union_id")
        base_url = _string(body.get("base_url", "https://open.feishu.cn"), f"{sub}.base_url").rstrip("/")
        _check_url(Secret(base_url, "base_url"), f"{sub}.base_url")
        integration = FeishuPhone(
            app_id=_secret(body["app_id"], f"{sub}.app_id", secrets, plain_ok=True),
            app_secret=_secret(body["app_secret"], f"{sub}.app_secret", secrets, plain_ok=False),
            user_ids=user_ids,
            base_url=base_url,
            user_id_type=user_id_type,
        )
    else:
        body = _mapping(entry[kind], sub, {"url", "bearer_token"}, required={"url"})
        integration = Webhook(
            url=_secret(body["url"], f"{sub}.url", secrets, plain_ok=True),
            bearer_token=(
                _secret(body["bearer_token"], f"{sub}.bearer_token", secrets, plain_ok=False)
                if "bearer_token" in body
                else None
            ),
        )
        _check_url(integration.url, f"{sub}.url")
    return ReceiverConfig(
        name=name,
        integration=integration,
        send_resolved=_bool(entry.get("send_resolved", True), f"{path}.send_resolved"),
    )


def _secret(data: Any, path: str, secrets: SecretResolver, plain_ok: bool) -> Secret:
    if isinstance(data, str):
        if not plain_ok:
            raise ConfigError(
                f"{path}: a credential must come from a Secret: write {{secretKeyRef: {{name: <secret>, key: <key>}}}}"
            )
        return Secret(data, path)
    ref = _mapping(
        _mapping(data, path, {"secretKeyRef"}, required={"secretKeyRef"})["secretKeyRef"],
        f"{path}.secretKeyRef",
        {"name", "key"},
        required={"name", "key"},
    )
    name = _string(ref["name"], f"{path}.secretKeyRef.name")
    key = _string(ref["key"], f"{path}.secretKeyRef.key")
    try:
        value = secrets(name, key)
    except LookupError as error:
        raise ConfigError(f"{path}: {error.args[0] if error.args else error}") from None
    if not value:
        raise ConfigError(f"{path}: Secret {name} key {key!r} is empty")
    return Secret(value.strip(), f"{name}/{key}")


def _check_url(url: Secret, path: str) -> None:
    if not re.match(r"^https?://[^/\s]+", url.reveal()):
        # The value may be a credential: name its source, not its text.
        raise ConfigError(f"{path} ({url.source}): not an http(s) URL")


# -- routes -------------------------------------------------------------------------------------

_ROUTE_FIELDS = {
    "receiver",
    "matchers",
    "group_by",
    "group_wait",
    "group_interval",
    "repeat_interval",
    "continue",
    "routes",
}


def _route(data: Any, path: str, parent: RouteConfig | None, receivers: Mapping[str, ReceiverConfig]) -> RouteConfig:
    entry = _mapping(data, path, _ROUTE_FIELDS, required=set() if parent else {"receiver"})
    if parent is None and "matchers" in entry:
        raise ConfigError(f"{path}.matchers: the root route matches every alert; put matchers on its routes")
    receiver = _string(entry.get("receiver", parent.receiver if parent else ""), f"{path}.receiver")
    if receiver not in receivers:
        raise ConfigError(f"{path}.receiver: no receiver named {receiver!r} (defined: {', '.join(receivers)})")
    inherit = parent or RouteConfig(receiver=receiver, path=path)
    group_by = inherit.group_by
    if "group_by" in entry:
        group_by = _strings(entry["group_by"], f"{path}.group_by")
        if ALL_LABELS in group_by and len(group_by) > 1:
            raise ConfigError(f"{path}.group_by: '...' (every label) stands alone")
    route = RouteConfig(
        receiver=receiver,
        path=path,
        matchers=_matchers(entry.get("matchers", []), f"{path}.matchers"),
        group_by=group_by,
        group_wait=_duration(entry.get("group_wait", inherit.group_wait), f"{path}.group_wait"),
        group_interval=_duration(entry.get("group_interval", inherit.group_interval), f"{path}.group_interval", True),
        repeat_interval=_duration(
            entry.get("repeat_interval", inherit.repeat_interval), f"{path}.repeat_interval", True
        ),
        continue_=_bool(entry.get("continue", False), f"{path}.continue"),
    )
    children = tuple(
        _route(child, f"{path}.routes[{i}]", route, receivers)
        for i, child in enumerate(_list(entry.get("routes"), path))
    )
    return replace(route, routes=children)


def _matchers(data: Any, path: str) -> tuple[Matcher, ...]:
    result = []
    for index, item in enumerate(_list(data, path)):
        try:
            result.append(Matcher.parse(item))
        except MatcherError as error:
            raise ConfigError(f"{path}[{index}]: {error}") from None
    return tuple(result)


def _inhibit_rule(data: Any, path: str) -> InhibitRule:
    entry = _mapping(
        data, path, {"source_matchers", "target_matchers", "equal"}, required={"source_matchers", "target_matchers"}
    )
    rule = InhibitRule(
        source_matchers=_matchers(entry["source_matchers"], f"{path}.source_matchers"),
        target_matchers=_matchers(entry["target_matchers"], f"{path}.target_matchers"),
        equal=_strings(entry.get("equal", []), f"{path}.equal"),
    )
    if not rule.source_matchers or not rule.target_matchers:
        raise ConfigError(f"{path}: source_matchers and target_matchers must not be empty (it would mute everything)")
    return rule


def _silence(data: Any, path: str) -> SilenceConfig:
    entry = _mapping(
        data, path, {"matchers", "starts_at", "ends_at", "created_by", "comment"}, required={"matchers", "ends_at"}
    )
    matchers = _matchers(entry["matchers"], f"{path}.matchers")
    if not matchers:
        raise ConfigError(f"{path}.matchers: a silence needs at least one matcher")
    starts_at = _time(entry["starts_at"], f"{path}.starts_at") if "starts_at" in entry else 0.0
    ends_at = _time(entry["ends_at"], f"{path}.ends_at")
    if ends_at <= starts_at:
        raise ConfigError(f"{path}.ends_at: must be after starts_at")
    return SilenceConfig(
        matchers=matchers,
        starts_at=starts_at,
        ends_at=ends_at,
        created_by=_string(entry.get("created_by", "config"), f"{path}.created_by"),
        comment=_string(entry.get("comment", ""), f"{path}.comment"),
    )


# -- the rest -----------------------------------------------------------------------------------


def _storm(data: Any) -> StormConfig:
    entry = _mapping(data, "storm", {"max_alerts", "window"})
    defaults = StormConfig()
    return StormConfig(
        max_alerts=_int(entry.get("max_alerts", defaults.max_alerts), "storm.max_alerts", minimum=1),
        window=_duration(entry.get("window", defaults.window), "storm.window", positive=True),
    )


def _delivery(data: Any) -> DeliveryConfig:
    entry = _mapping(
        data, "delivery", {"timeout", "attempts", "backoff", "max_backoff", "concurrency", "pause_after_config_error"}
    )
    d = DeliveryConfig()
    return DeliveryConfig(
        timeout=_duration(entry.get("timeout", d.timeout), "delivery.timeout", positive=True),
        attempts=_int(entry.get("attempts", d.attempts), "delivery.attempts", minimum=1),
        backoff=_duration(entry.get("backoff", d.backoff), "delivery.backoff"),
        max_backoff=_duration(entry.get("max_backoff", d.max_backoff), "delivery.max_backoff"),
        concurrency=_int(entry.get("concurrency", d.concurrency), "delivery.concurrency", minimum=1),
        pause_after_config_error=_duration(
            entry.get("pause_after_config_error", d.pause_after_config_error), "delivery.pause_after_config_error"
        ),
    )


def _report(data: Any, receivers: Mapping[str, ReceiverConfig]) -> ReportConfig:
    entry = _mapping(data, "report", {"receiver", "weekday", "time", "timezone", "top"})
    receiver = entry.get("receiver")
    if receiver is not None:
        receiver = _string(receiver, "report.receiver")
        if receiver not in receivers:
            raise ConfigError(f"report.receiver: no receiver named {receiver!r} (defined: {', '.join(receivers)})")
        if isinstance(receivers[receiver].integration, FeishuPhone):
            raise ConfigError(
                f"report.receiver: {receiver!r} is a phone receiver; send the report to a card or webhook"
            )
    weekday = _string(entry.get("weekday", "monday"), "report.weekday").lower()
    if weekday not in WEEKDAYS:
        raise ConfigError(f"report.weekday: {weekday!r} is not a weekday ({', '.join(WEEKDAYS)})")
    clock = _string(entry.get("time", "09:00"), "report.time")
    found = re.fullmatch(r"([01]?\d|2[0-3]):([0-5]\d)", clock)
    if not found:
        raise ConfigError(f"report.time: {clock!r} is not HH:MM (24 h)")
    timezone = _string(entry.get("timezone", "UTC"), "report.timezone")
    try:
        zoneinfo.ZoneInfo(timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ConfigError(f"report.timezone: unknown time zone {timezone!r} (e.g. UTC, Asia/Shanghai)") from None
    return ReportConfig(
        receiver=receiver,
        weekday=WEEKDAYS.index(weekday),
        hour=int(found.group(1)),
        minute=int(found.group(2)),
        timezone=timezone,
        top=_int(entry.get("top", 5), "report.top", minimum=1),
    )


def _intake(data: Any, secrets: SecretResolver) -> IntakeConfig:
    entry = _mapping(data, "intake", {"bearer_token", "severity_levels", "default_level"})
    levels = dict(DEFAULT_SEVERITY_LEVELS)
    for severity, level in _mapping(entry.get("severity_levels", {}), "intake.severity_levels", None).items():
        levels[str(severity).lower()] = _level(level, f"intake.severity_levels.{severity}")
    return IntakeConfig(
        bearer_token=(
            _secret(entry["bearer_token"], "intake.bearer_token", secrets, plain_ok=False)
            if "bearer_token" in entry
            else None
        ),
        severity_levels=levels,
        default_level=_level(entry.get("default_level", "P3"), "intake.default_level"),
    )


def _store(data: Any) -> StoreConfig:
    entry = _mapping(data, "store", {"path", "configMap", "retention"})
    d = StoreConfig()
    if "path" in entry and "configMap" in entry:
        raise ConfigError("store: give either path (a SQLite file) or configMap (in the API server), not both")
    name = _string(entry.get("configMap", d.config_map), "store.configMap")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?", name):
        raise ConfigError(f"store.configMap: {name!r} is not a ConfigMap name (lowercase, digits, '-'; at most 52)")
    return StoreConfig(
        config_map=name,
        path=_string(entry["path"], "store.path") if "path" in entry else None,
        retention=_duration(entry.get("retention", d.retention), "store.retention", positive=True),
    )


# -- scalar readers -----------------------------------------------------------------------------

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(value: Any) -> float:
    """``30s``, ``5m``, ``1h30m``, ``250ms``, ``7d`` or a number of seconds."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, int | float):
        return float(value)
    text = str(value).strip()
    if not text or _DURATION_PART.sub("", text):
        raise ValueError(value)
    return sum(float(n) * _UNIT_SECONDS[unit] for n, unit in _DURATION_PART.findall(text))


def _duration(value: Any, path: str, positive: bool = False) -> float:
    try:
        seconds = parse_duration(value)
    except ValueError:
        raise ConfigError(f"{path}: {value!r} is not a duration (write e.g. 30s, 5m, 4h)") from None
    if seconds < 0 or (positive and seconds == 0):
        raise ConfigError(f"{path}: {value!r} must be {'positive' if positive else 'zero or more'}")
    return seconds


def _time(value: Any, path: str) -> float:
    if hasattr(value, "timestamp"):  # YAML parses unquoted ISO times into datetimes
        if getattr(value, "tzinfo", None) is None:
            raise ConfigError(f"{path}: give a time zone, e.g. 2026-12-01T08:00:00Z")
        return value.timestamp()
    try:
        return parse_rfc3339(str(value))
    except ValueError:
        raise ConfigError(f"{path}: {value!r} is not an RFC 3339 time like 2026-12-01T08:00:00Z") from None


def _level(value: Any, path: str) -> Level:
    try:
        return Level.parse(str(value))
    except ValueError as error:
        raise ConfigError(f"{path}: {error}") from None


def _mapping(value: Any, path: str, known: set[str] | None, required: set[str] = frozenset()) -> dict[str, Any]:
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
    if known is not None:
        unknown = sorted(set(map(str, value)) - known)
        if unknown:
            raise ConfigError(f"{path}: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
    missing = sorted(required - set(value))
    if missing:
        raise ConfigError(f"{path}.{missing[0]}: required")
    return dict(value)


def _list(value: Any, path: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
    return value


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{path}: expected a string, got {type(value).__name__}")
    return value


def _strings(value: Any, path: str) -> tuple[str, ...]:
    return tuple(_string(item, f"{path}[{i}]") for i, item in enumerate(_list(value, path)))


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    return value


def _int(value: Any, path: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{path}: expected a whole number >= {minimum}, got {value!r}")
    return value
