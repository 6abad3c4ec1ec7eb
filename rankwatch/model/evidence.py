"""The keys of a finding's evidence that more than one module reads, and their types.

The rest of the evidence is each detector's own numbers (shown in reports and alerts as they are);
these few are read elsewhere too, so their spelling and shape live here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

NODE_ALERTS = "node_alerts"
"""list[NodeAlertEvidence]: the infrastructure alerts firing on the finding's nodes when it was made."""
STUCK = "stuck"
"""bool: every member of a hang sits inside one collective (the job reads ``StuckInCollective``)."""
SOURCE = "source"
"""str: what a detector's suspicion rests on (``stall_report``, ``host_starved``, ``step_time``...)."""
SLOWDOWN = "slowdown"
"""float: how much slower a straggler is (0.5 = 50 % slower)."""
DEGRADATION = "degradation"
"""float: how much slower a fail-slow job's step is against its own baseline."""

HOST_STARVED = "host_starved"
"""The ``source`` of a suspicion from the hosts' run-queue delays (``detector.host_starved``)."""


class NodeAlertEvidence(TypedDict):
    """One entry of ``evidence[NODE_ALERTS]``."""

    name: str
    node: str
    severity: str
    summary: str
    since: str
    source: str  # "prometheus" or "alertmanager"
    text: str  # the one line a person reads


def node_alert_lines(evidence: Mapping[str, Any]) -> list[str]:
    """The firing node alerts in ``evidence``, one line each."""
    return [str(alert.get("text", "")) for alert in evidence.get(NODE_ALERTS) or []]


def slowdown_of(evidence: Mapping[str, Any]) -> float | None:
    """How much slower the finding measured (a straggler's ``slowdown``, else a fail-slow's
    ``degradation``), None when it measured neither."""
    value = evidence.get(SLOWDOWN, evidence.get(DEGRADATION))
    return float(value) if isinstance(value, int | float) else None
