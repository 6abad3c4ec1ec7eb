"""Which routes an alert takes, and which notification group it joins on each.

Alertmanager's semantics, kept exactly so its documentation applies: depth first, the first
matching child wins unless it says ``continue``; a route none of whose children match handles the
alert itself. A group is (route, values of the route's ``group_by`` labels).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from rankwatch.alerting.config import ALL_LABELS, RouteConfig
from rankwatch.alerting.matchers import matches_all
from rankwatch.alerting.model import Alert


@dataclass(frozen=True)
class GroupKey:
    route: RouteConfig
    labels: tuple[tuple[str, str], ...]
    """The group_by labels and their values, sorted."""

    @cached_property
    def key(self) -> str:
        """Stable across restarts and config reloads that keep the route where it is."""
        digest = hashlib.sha256(json.dumps([self.route.path, self.labels]).encode()).hexdigest()[:16]
        return f"{self.route.path}:{digest}"

    @property
    def receiver(self) -> str:
        return self.route.receiver


def matching_routes(route: RouteConfig, labels: Mapping[str, str]) -> list[RouteConfig]:
    if not matches_all(route.matchers, labels):
        return []
    found: list[RouteConfig] = []
    for child in route.routes:
        matched = matching_routes(child, labels)
        found.extend(matched)
        if matched and not child.continue_:
            break
    return found or [route]


def group_keys(root: RouteConfig, alert: Alert) -> list[GroupKey]:
    labels = alert.match_labels()
    keys = []
    for route in matching_routes(root, labels):
        if ALL_LABELS in route.group_by:
            grouped = tuple(sorted(alert.labels.items()))
        else:
            grouped = tuple(sorted((name, labels.get(name, "")) for name in route.group_by))
        keys.append(GroupKey(route, grouped))
    return keys
