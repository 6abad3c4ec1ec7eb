"""The cluster-wide circuit breaker: how many more nodes rankwatch may cordon now.

Independent hardware faults are rare (Meta's Llama 3 run saw about 8 unexpected interruptions a
day on ~2,000 nodes), so many nodes blamed within minutes point at a shared cause (a switch, the
storage, a bug in detection) that cordoning cannot fix and would turn into a capacity outage. The
breaker caps the nodes rankwatch cordoned within a sliding window at a share of all nodes.

State is derived from the nodes' own annotations (``rankwatch.io/cordon-time`` on nodes still
cordoned by rankwatch), never from memory: it survives restarts and two operator replicas see the
same count. The breaker only ever limits cordoning; undoing a cordon never consults it.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass

from rankwatch.operator.config import BreakerSettings
from rankwatch.operator.remediation.node_marks import NodeView


@dataclass(frozen=True)
class BreakerState:
    total_nodes: int
    cap: int
    recent: tuple[str, ...]
    """Nodes rankwatch cordoned within the window, oldest first."""

    @property
    def room(self) -> int:
        return max(0, self.cap - len(self.recent))

    def describe(self, settings: BreakerSettings) -> str:
        return (
            f"{len(self.recent)} of {self.total_nodes} nodes cordoned by rankwatch in the last "
            f"{_duration(settings.window_seconds)} (cap {self.cap}: {settings.max_share:.0%} of the nodes, "
            f"at least {settings.min_nodes})"
        )


def state(nodes: Iterable[NodeView], settings: BreakerSettings, now: datetime.datetime) -> BreakerState:
    """Count rankwatch's cordons within the window; a cordon with an unreadable time counts as recent."""
    nodes = list(nodes)
    since = now - datetime.timedelta(seconds=settings.window_seconds)
    recent = []
    for node in nodes:
        mark = node.mark
        if mark is None or not mark.cordoned:
            continue
        moment = mark.time or now  # unreadable: assume the worst
        if moment >= since:
            recent.append((moment, node.name))
    recent.sort()
    return BreakerState(len(nodes), settings.cap(len(nodes)), tuple(name for _, name in recent))


def excess(breaker: BreakerState) -> int:
    """Cordons beyond the cap: how many a replica that just cordoned must take back.

    Two replicas can decide at once, each seeing room for one more. Each re-reads after writing
    and, if the count is over the cap, rolls back that many of its own new cordons (or all of
    them). Of the replicas that keep cordons, the one that re-read last saw every kept cordon
    (each was written before its writer re-read), so the kept total never exceeds the cap; at
    worst both roll back and the next diagnosis tries again.
    """
    return max(0, len(breaker.recent) - breaker.cap)


def _duration(seconds: float) -> str:
    if seconds % 3600 == 0:
        return f"{int(seconds // 3600)}h"
    if seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    return f"{seconds:g}s"
