"""Training-job findings (``rankwatch.analysis.findings.Finding``) as alerts.

Labels (the identity) say what and where: kind, job, nodes, ranks, communicator. The same culprit
found again by the next diagnosis is the same alert (deduplicated, repeated at repeat_interval);
another rank or node is another alert. Cause, confidence and evidence are annotations: they change
from one diagnosis to the next without making a new alert.
"""

from __future__ import annotations

import json
import time

from rankwatch.alerting.model import Alert, Level
from rankwatch.analysis.findings import Finding
from rankwatch.operator.spec import Alerting

MAX_RANKS_IN_LABEL = 16


def alert_from_finding(
    namespace: str,
    job: str,
    finding: Finding,
    alerting: Alerting | None = None,
    now: float | None = None,
    report_url: str = "",
) -> Alert:
    """The alert for one finding of job ``namespace/job``, levelled by the job's ``spec.alerting``."""
    alerting = alerting or Alerting()
    ranks = sorted(finding.ranks)
    rank_label = ",".join(map(str, ranks[:MAX_RANKS_IN_LABEL]))
    if len(ranks) > MAX_RANKS_IN_LABEL:
        rank_label += f",+{len(ranks) - MAX_RANKS_IN_LABEL}"
    labels = {
        "alertname": finding.kind.alert_name,
        "kind": finding.kind.value,
        "namespace": namespace,
        "trainingjob": job,
        "route": alerting.route,
        "node": ",".join(sorted(finding.nodes)),
        "rank": rank_label,
    }
    if finding.communicator:
        labels["communicator"] = finding.communicator
    annotations = {
        "summary": finding.summary,
        "cause": finding.cause_text,
        "confidence": f"{finding.confidence:.2f}",
        "evidence": json.dumps(finding.evidence, sort_keys=True, default=str),
    }
    node_alerts = [str(alert.get("text", "")) for alert in finding.evidence.get("node_alerts") or []]
    if node_alerts:
        annotations["node_alerts"] = "\n".join(node_alerts)
    if report_url:
        annotations["report_url"] = report_url
    return Alert(
        labels={k: v for k, v in labels.items() if v},
        level=Level.parse(alerting.levels.for_finding(finding.kind)),
        starts_at=time.time() if now is None else now,
        annotations=annotations,
    )
