"""What receivers are asked to deliver: a group notification, a storm summary, the weekly report, a test.

Receivers render these (a Feishu card, a phone message, webhook JSON); nothing else crosses the
boundary between deciding what to say and saying it.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from rankwatch.alerting.model import Alert, Level, most_urgent


@dataclass(frozen=True)
class Notification:
    """The alerts of one group that a receiver should hear about now."""

    receiver: str
    group_key: str
    group_labels: Mapping[str, str]
    firing: tuple[Alert, ...]
    resolved: tuple[Alert, ...] = ()
    repeat: bool = False
    """Nothing new: sent because repeat_interval passed with the alerts still firing."""

    @property
    def level(self) -> Level:
        return most_urgent([a.level for a in self.firing] or [a.level for a in self.resolved])

    @property
    def status(self) -> str:
        return "firing" if self.firing else "resolved"

    @property
    def alerts(self) -> tuple[Alert, ...]:
        return self.firing + self.resolved

    @property
    def key(self) -> str:
        parts = [self.receiver, self.group_key, *sorted(a.fingerprint for a in self.firing), "|"]
        parts += sorted(a.fingerprint for a in self.resolved)
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class StormSummary:
    """Notifications held back because a receiver got too many in one window, told as one message."""

    receiver: str
    window_start: float
    window_end: float
    notifications: tuple[Notification, ...]

    @property
    def firing(self) -> list[Alert]:
        return [a for n in self.notifications for a in n.firing]

    @property
    def resolved(self) -> list[Alert]:
        return [a for n in self.notifications for a in n.resolved]

    @property
    def level(self) -> Level:
        return most_urgent([n.level for n in self.notifications])

    @property
    def by_level(self) -> dict[Level, int]:
        counts = Counter(a.level for a in self.firing)
        return {level: counts.get(level, 0) for level in Level}

    def top(self, label: str, count: int = 5) -> list[tuple[str, int]]:
        values = Counter(a.labels.get(label, "") for a in self.firing)
        values.pop("", None)
        return values.most_common(count)

    @property
    def key(self) -> str:
        return hashlib.sha256(
            "\0".join([self.receiver, str(self.window_start), *(n.key for n in self.notifications)]).encode()
        ).hexdigest()[:16]


@dataclass(frozen=True)
class TopAlert:
    name: str
    scope: str
    """The job (namespace/name) or node it fired on, or empty."""
    count: int
    level: Level


@dataclass(frozen=True)
class WeeklyReport:
    receiver: str
    start: float
    end: float
    counts: Mapping[Level, int]
    top: tuple[TopAlert, ...] = ()
    resolved: int = 0
    still_firing: int = 0
    mean_time_to_resolve: float | None = None
    """Seconds, over the alerts that started and resolved in the period; None when none resolved."""

    level: Level = Level.P3

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def key(self) -> str:
        return f"report-{self.receiver}-{int(self.start)}-{int(self.end)}"


@dataclass(frozen=True)
class TestMessage:
    """``rankwatch alerts test``: proves the receiver's URL, secret and mentions work."""

    __test__ = False  # not a pytest class

    receiver: str
    level: Level
    sent_at: float
    note: str = field(default="Test notification from rankwatch: if you can read this, the receiver works.")

    @property
    def key(self) -> str:
        return f"test-{self.receiver}-{self.sent_at}"


Message = Notification | StormSummary | WeeklyReport | TestMessage
