"""``rankwatch nodes``: the nodes rankwatch took out of scheduling (or only annotated, in a dry run), for
which job, since when, why, read back from the nodes' own marks (``node_marks``), the only record of
what rankwatch did."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from rankwatch.operator.remediation import node_actions, node_marks
from rankwatch.operator.remediation.node_marks import NodeView


@dataclass(frozen=True)
class MarkedNode:
    """One node that carries rankwatch's mark, its taint, or a pending request to undo them."""

    view: NodeView

    @property
    def state(self) -> str:
        """``cordoned``, ``dry-run`` (annotated only), ``tainted`` (schedulable again, e.g. a hand
        `kubectl uncordon`, but the taint still keeps pods off), ``marked`` (neither), ``tainted, no mark``
        (the annotations were removed by hand), each ``+ uncordon requested`` while the operator has yet to undo."""
        mark, view = self.view.mark, self.view
        if mark is None:
            state = "tainted, no mark"
        elif mark.dry_run:
            state = "dry-run"
        elif view.unschedulable:
            state = "cordoned" + (" (already before)" if mark.was_unschedulable else "")
        else:
            state = "tainted" if view.has_our_taint else "marked"
        if view.annotations.get(node_marks.UNCORDON_REQUEST) == "true":
            state += ", uncordon requested"
        return state

    def to_json(self, now: datetime.datetime) -> dict[str, Any]:
        mark = self.view.mark
        since = mark.time if mark else None
        return {
            "node": self.view.name,
            "state": self.state,
            "job": mark.job if mark else "",
            "jobUid": mark.job_uid if mark else "",
            "reason": mark.reason if mark else "",
            "since": node_marks.format_time(since) if since else None,
            "ageSeconds": int((now - since).total_seconds()) if since else None,
            "tainted": self.view.has_our_taint,
            "unschedulable": self.view.unschedulable,
            "evidence": mark.evidence if mark else "",
        }


def marked_nodes(api: client.ApiClient, job: str | None = None) -> list[MarkedNode]:
    """Nodes rankwatch marked or tainted, oldest mark first; ``job``: only those of ``namespace/name``."""
    nodes = node_actions.list_nodes(api)
    found = [
        MarkedNode(view)
        for view in nodes.values()
        if view.mark is not None or view.has_our_taint or node_marks.UNCORDON_REQUEST in view.annotations
    ]
    if job:
        found = [node for node in found if node.view.mark is not None and node.view.mark.job == job]
    oldest = datetime.datetime.min.replace(tzinfo=datetime.UTC)
    return sorted(found, key=lambda node: (node.view.mark.time if node.view.mark and node.view.mark.time else oldest,
                                           node.view.name))  # fmt: skip


def table(nodes: list[MarkedNode], now: datetime.datetime) -> str:
    rows = [("NODE", "STATE", "JOB", "SINCE (UTC)", "AGE", "REASON")]
    for node in nodes:
        about = node.to_json(now)
        since = (about["since"] or "")[:19].replace("T", " ")
        rows.append(
            (about["node"], about["state"], about["job"] or "-", since or "-", _age(about["ageSeconds"]),
             about["reason"] or "-")
        )  # fmt: skip
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def _age(seconds: int | None) -> str:
    """kubectl's way: 45s, 12m, 3h, 2d."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"
