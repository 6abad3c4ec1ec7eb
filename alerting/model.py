"""What an alert is: labels (its identity), a level P0–P3, annotations and a firing interval.

Both sources produce this one structure: training-job findings (``findings.py``) and the cluster's
Prometheus alerts arriving through the Alertmanager webhook (``intake.py``); everything after that
(routing, dedup, silences, delivery, the report) sees only ``Alert``.
"""

from __future__ import annotations

import datetime
import enum
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from rankwatch import timestamps


class Level(enum.StrEnum):
    """P0 pages a phone (job hung, GPU off the bus); P1 straggler, node down; P2 degradation; P3 notice."""

    P0 = "P0"
    P1 = "P1"
    P2 = "P2"
    P3 = "P3"

    @property
    def rank(self) -> int:
        """0 is the most urgent; ``min(levels, key=rank)`` is the level of a group."""
        return int(self.value[1])

    @classmethod
    def parse(cls, value: str) -> Level:
        try:
            return cls(value.strip().upper())
        except ValueError:
            raise ValueError(f"{value!r} is not a level (P0, P1, P2 or P3)") from None


def most_urgent(levels: list[Level]) -> Level:
    return min(levels, key=lambda level: level.rank) if levels else Level.P3


def fingerprint(labels: Mapping[str, str]) -> str:
    """A stable hash of the sorted label set: equal labels, equal fingerprint, in any process."""
    canonical = json.dumps(sorted(labels.items()), separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Alert:
    """One alert. Times are Unix seconds; ``ends_at`` in the past means resolved.

    ``level`` is not a label: the same condition re-levelled by a config change keeps its identity.
    Matchers (routes, inhibition, silences) see the labels plus ``level`` (see ``match_labels``).
    """

    labels: Mapping[str, str]
    level: Level
    starts_at: float
    annotations: Mapping[str, str] = field(default_factory=dict)
    ends_at: float | None = None
    generator_url: str = ""
    source: str = "rankwatch"
    """Where it came from, ``rankwatch`` (a job finding) or ``alertmanager``; a bounded metrics label."""

    @cached_property
    def fingerprint(self) -> str:
        return fingerprint(self.labels)

    @property
    def name(self) -> str:
        return self.labels.get("alertname", "alert")

    def resolved(self, now: float) -> bool:
        return self.ends_at is not None and self.ends_at <= now

    def match_labels(self) -> dict[str, str]:
        return {**self.labels, "level": self.level.value}

    def resolve(self, at: float) -> Alert:
        return replace(self, ends_at=at)

    def to_json(self) -> dict[str, Any]:
        return {
            "labels": dict(self.labels),
            "level": self.level.value,
            "startsAt": self.starts_at,
            "endsAt": self.ends_at,
            "annotations": dict(self.annotations),
            "generatorURL": self.generator_url,
            "source": self.source,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Alert:
        return cls(
            labels=dict(data["labels"]),
            level=Level(data["level"]),
            starts_at=float(data["startsAt"]),
            ends_at=None if data.get("endsAt") is None else float(data["endsAt"]),
            annotations=dict(data.get("annotations") or {}),
            generator_url=data.get("generatorURL", ""),
            source=data.get("source", "rankwatch"),
        )


NODE_LABELS = ("node", "kubernetes_node", "nodename", "hostname", "instance")
"""Labels naming the node, ours first, then what Prometheus exporters commonly set."""


def job_of(alert: Alert) -> str:
    """``namespace/trainingjob``, or empty: a Prometheus alert's ``job`` label is its scrape job
    (``dcgm-exporter``), which tells the person paged nothing; the node does."""
    labels = alert.labels
    if labels.get("trainingjob"):
        return f"{labels.get('namespace', '')}/{labels['trainingjob']}".lstrip("/")
    return ""


def node_of(alert: Alert) -> str:
    return next((alert.labels[name] for name in NODE_LABELS if alert.labels.get(name)), "")


def rfc3339(seconds: float) -> str:
    """UTC, second precision, ``Z`` suffix: what Alertmanager and Kubernetes print."""
    return timestamps.rfc3339(datetime.datetime.fromtimestamp(seconds, datetime.UTC))


def parse_rfc3339(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
