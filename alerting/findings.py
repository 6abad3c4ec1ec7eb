"""Training-job findings (``rankwatch.model.finding.Finding``) as alerts.

Labels (the identity) say what and where: kind, job, nodes, ranks, communicator. The same culprit
found again by the next diagnosis is the same alert (deduplicated, repeated at repeat_interval);
another rank or node is another alert. Cause, confidence and evidence are annotations: they change
from one diagnosis to the next without making a new alert.

A finding's text comes partly from the job (its Python frames, its profile's function names), so
every annotation is bounded (``tenant_text``): one job's 40 KB function names cannot fill the alert
store that every team's alerts share.
"""

from __future__ import annotations

import json
import time
from typing import Any

from rankwatch import tenant_text
from rankwatch.alerting.model import Alert, Level
from rankwatch.model.evidence import node_alert_lines
from rankwatch.model.finding import Finding

MAX_RANKS_IN_LABEL = 16
MAX_LABEL = 256
MAX_SUMMARY = 1000
MAX_CAUSE = 2000
MAX_EVIDENCE_STRING = 256
"""Each string inside the evidence (a frame's file and function, a profile's function names)."""
MAX_EVIDENCE = 8 << 10
"""The evidence annotation (JSON): entries past it are left out, and named under ``omitted``."""
MAX_NODE_ALERTS = 4000
NODE_ALERTS_ANNOTATION = "node_alerts"
"""The alert annotation with the finding's firing node alerts, one a line (a card shows it)."""


def bounded_evidence(evidence: dict[str, Any]) -> str:
    """The evidence as JSON, each string in it and the whole bounded; what is left out is named."""
    kept: dict[str, Any] = {}
    omitted: list[str] = []
    for key, value in tenant_text.bounded_strings(evidence, MAX_EVIDENCE_STRING).items():
        trial = {**kept, key: value, **({"omitted": omitted} if omitted else {})}
        if len(json.dumps(trial, sort_keys=True, default=str)) + MAX_EVIDENCE_STRING <= MAX_EVIDENCE:
            kept[key] = value
        else:
            omitted.append(key)
    if omitted:
        kept["omitted"] = omitted
    return json.dumps(kept, sort_keys=True, default=str)


def alert_from_finding(
    namespace: str,
    job: str,
    finding: Finding,
    route: str = "default",
    level: str | None = None,
    now: float | None = None,
    report_url: str = "",
    job_kind: str = "TrainingJob",
) -> Alert:
    """The alert for one finding of job ``namespace/job``, with the job's ``spec.alerting``: its
    ``route`` label and the ``level`` it gives the finding's kind (default: the kind's own). A job of
    another kind (``job_kind``: Job, JobSet...) carries its kind as label ``jobkind``."""
    ranks = sorted(finding.ranks)
    rank_label = ",".join(map(str, ranks[:MAX_RANKS_IN_LABEL]))
    if len(ranks) > MAX_RANKS_IN_LABEL:
        rank_label += f",+{len(ranks) - MAX_RANKS_IN_LABEL}"
    labels = {
        "alertname": finding.kind.alert_name,
        "kind": finding.kind.value,
        "namespace": namespace,
        "trainingjob": job,
        "route": route,
        "node": tenant_text.bounded(",".join(sorted(finding.nodes)), MAX_LABEL),
        "rank": rank_label,
    }
    if job_kind != "TrainingJob":
        labels["jobkind"] = job_kind
    if finding.communicator:
        labels["communicator"] = finding.communicator
    annotations = {
        "summary": tenant_text.bounded(finding.summary, MAX_SUMMARY),
        "cause": tenant_text.bounded(finding.cause_text, MAX_CAUSE),
        "confidence": f"{finding.confidence:.2f}",
        "evidence": bounded_evidence(finding.evidence),
    }
    node_alerts = node_alert_lines(finding.evidence)
    if node_alerts:
        annotations[NODE_ALERTS_ANNOTATION] = tenant_text.bounded("\n".join(node_alerts), MAX_NODE_ALERTS)
    if report_url:
        annotations["report_url"] = report_url
    return Alert(
        labels={k: v for k, v in labels.items() if v},
        level=Level.parse(level or finding.kind.default_level),
        starts_at=time.time() if now is None else now,
        annotations=annotations,
    )
