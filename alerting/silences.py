"""Silences: matchers with a time window; an alert matching an active one is not notified.

Silences from the config are fixed; silences added at run time (intake API, CLI) are stored, so a
restart keeps them, and they expire by themselves at ``ends_at``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from rankwatch.alerting.matchers import Matcher, matches_all
from rankwatch.alerting.model import Alert, rfc3339


@dataclass(frozen=True)
class Silence:
    matchers: tuple[Matcher, ...]
    starts_at: float
    ends_at: float
    created_by: str = ""
    comment: str = ""
    id: str = ""

    @classmethod
    def new(
        cls, matchers: Iterable[Matcher], starts_at: float, ends_at: float, created_by: str = "", comment: str = ""
    ) -> Silence:
        matchers = tuple(matchers)
        if not matchers:
            raise ValueError("a silence needs at least one matcher")
        if ends_at <= starts_at:
            raise ValueError("a silence must end after it starts")
        return cls(matchers, starts_at, ends_at, created_by, comment, uuid.uuid4().hex[:12])

    def active(self, now: float) -> bool:
        return self.starts_at <= now < self.ends_at

    def mutes(self, alert: Alert, now: float) -> bool:
        return self.active(now) and matches_all(self.matchers, alert.match_labels())

    def state(self, now: float) -> str:
        """``pending`` (starts later), ``active`` or ``expired``, as Alertmanager names them."""
        return "pending" if now < self.starts_at else "active" if now < self.ends_at else "expired"

    def to_json(self, now: float | None = None) -> dict:
        """The API's shape; with ``now``, also its ``status.state``."""
        status = {"status": {"state": self.state(now)}} if now is not None else {}
        return {
            **status,
            "id": self.id,
            "matchers": [str(m) for m in self.matchers],
            "startsAt": rfc3339(self.starts_at),
            "endsAt": rfc3339(self.ends_at),
            "createdBy": self.created_by,
            "comment": self.comment,
        }


def silenced_by(alert: Alert, silences: Iterable[Silence], now: float) -> Silence | None:
    return next((silence for silence in silences if silence.mutes(alert, now)), None)
