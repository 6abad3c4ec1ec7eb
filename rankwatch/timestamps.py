"""RFC 3339 timestamps as Kubernetes and Alertmanager print them: UTC, second precision, ``Z``."""

from __future__ import annotations

import datetime


def rfc3339(moment: datetime.datetime) -> str:
    """``2026-11-28T17:40:00Z`` for an aware moment (any zone), sub-seconds dropped."""
    return moment.astimezone(datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def rfc3339_now() -> str:
    return rfc3339(datetime.datetime.now(datetime.UTC))
