"""Inhibition: a firing alert mutes others it explains (a node down mutes the P1s of jobs on that node)."""

from __future__ import annotations

from collections.abc import Iterable

from rankwatch.alerting.config import InhibitRule
from rankwatch.alerting.matchers import matches_all
from rankwatch.alerting.model import Alert


def inhibited_by(
    alert: Alert, rules: Iterable[InhibitRule], firing: Iterable[Alert], now: float
) -> tuple[InhibitRule, Alert] | None:
    """The rule and source alert that mute ``alert``, or None. An alert never inhibits itself."""
    target = alert.match_labels()
    rules = [rule for rule in rules if matches_all(rule.target_matchers, target)]
    if not rules:
        return None
    own = alert.fingerprint
    for source in firing:
        if source.resolved(now) or source.fingerprint == own:
            continue
        labels = source.match_labels()
        for rule in rules:
            if matches_all(rule.source_matchers, labels) and all(
                labels.get(name, "") == target.get(name, "") for name in rule.equal
            ):
                return rule, source
    return None
