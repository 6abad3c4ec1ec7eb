"""The weekly report: alerts by level, the most frequent ones, mean time to resolve; and when it is due.

Counted from the stored history of firings (one per alert per time it started firing), so the
figures survive restarts and do not depend on what was notified (a silenced alert still counts).
"""

from __future__ import annotations

import datetime
import zoneinfo
from collections import Counter

from rankwatch.alerting.config import ReportConfig
from rankwatch.alerting.messages import TopAlert, WeeklyReport
from rankwatch.alerting.model import Level, most_urgent
from rankwatch.alerting.store import AlertStore

WEEK = 7 * 86400.0


def weekly_report(store: AlertStore, receiver: str, end: float, top: int = 5, period: float = WEEK) -> WeeklyReport:
    start = end - period
    episodes = store.episodes(start, end)
    counts = Counter(e.level for e in episodes)
    durations = [e.ends_at - e.starts_at for e in episodes if e.ends_at is not None and e.ends_at <= end]
    by_alert: dict[tuple[str, str], list[Level]] = {}
    for episode in episodes:
        by_alert.setdefault((episode.alertname, episode.scope), []).append(episode.level)
    ranked = sorted(by_alert.items(), key=lambda item: (-len(item[1]), most_urgent(item[1]).rank, item[0]))
    return WeeklyReport(
        receiver=receiver,
        start=start,
        end=end,
        counts={level: counts.get(level, 0) for level in Level},
        top=tuple(TopAlert(name, scope, len(levels), most_urgent(levels)) for (name, scope), levels in ranked[:top]),
        resolved=len(durations),
        still_firing=sum(e.ends_at is None or e.ends_at > end for e in episodes),
        mean_time_to_resolve=sum(durations) / len(durations) if durations else None,
    )


def last_slot(config: ReportConfig, now: float) -> float:
    """The latest scheduled report time at or before ``now`` (e.g. last Monday 09:00 in the zone)."""
    zone = zoneinfo.ZoneInfo(config.timezone)
    local = datetime.datetime.fromtimestamp(now, zone)
    slot = local.replace(hour=config.hour, minute=config.minute, second=0, microsecond=0)
    slot -= datetime.timedelta(days=(local.weekday() - config.weekday) % 7)
    if slot > local:
        slot -= datetime.timedelta(days=7)
    return slot.timestamp()
