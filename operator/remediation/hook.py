"""The one place a new diagnosis is handed to remediation (cordon and taint the suspect nodes).

Called once per diagnosis written on a job (and again only if the operator died before it recorded
the outcome in ``status.diagnosis.remediation``: remediation reads what was done from the nodes, so
a second call changes nothing). The job's ``spec.remediation`` and the operator-wide safeguards
decide what happens (``rankwatch.operator.remediation.cordon``); every node's outcome is logged.
"""

from __future__ import annotations

import logging
from typing import Any

import kubernetes

from rankwatch.model.diagnosis_status import DiagnosisStatus
from rankwatch.model.finding import Finding
from rankwatch.operator.config import Safeguards
from rankwatch.operator.kinds.adapter import Group
from rankwatch.operator.remediation.cordon import RemediationResult, remediate_async
from rankwatch.operator.remediation.cordon_decision import CordonRequest, Outcome, RemediationPolicy
from rankwatch.operator.remediation.metrics import RemediationMetrics
from rankwatch.operator.spec import Remediation, TrainingJobSpec

log = logging.getLogger(__name__)


async def remediate(
    kube: kubernetes.client.ApiClient,
    job: dict[str, Any],
    finding: Finding,
    safeguards: Safeguards,
    metrics: RemediationMetrics,
) -> RemediationResult:
    """Cordon what the job's policy and the safeguards allow of the nodes ``finding`` blames; raises
    when the cluster could not be read (nothing was changed then: call again later)."""
    metadata = job["metadata"]
    name = f"{metadata['namespace']}/{metadata['name']}"
    spec = TrainingJobSpec.from_manifest(dict(job.get("spec") or {}))
    written = DiagnosisStatus.from_status(job.get("status"))
    diagnosis = written.time if written else ""  # the same across its retries
    request = CordonRequest(metadata["namespace"], metadata["name"], metadata.get("uid", ""), finding, diagnosis)
    result = await remediate_async(
        kube, request, RemediationPolicy.for_job(spec.remediation, safeguards), metrics=metrics
    )
    for decision in result.decisions:
        log.info("TrainingJob %s: node %s: %s (%s)", name, decision.node, decision.outcome.value, decision.message)
    return result


async def remediate_group(
    kube: kubernetes.client.ApiClient,
    group: Group,
    job_nodes: frozenset[str],
    finding: Finding,
    diagnosis: str,
    remediation: Remediation,
    safeguards: Safeguards,
    metrics: RemediationMetrics,
) -> RemediationResult:
    """As :func:`remediate`, for a group of another kind: its policy from its pods' annotations, its nodes
    those its own pods (as its adapter finds them) run on."""
    request = CordonRequest(group.namespace, group.name, group.uid, finding, diagnosis, group.kind, group.api_version)
    policy = RemediationPolicy.for_job(remediation, safeguards)
    result = await remediate_async(kube, request, policy, job_nodes, metrics=metrics)
    for decision in result.decisions:
        log.info("%s: node %s: %s (%s)", group, decision.node, decision.outcome.value, decision.message)
    return result


def outcome_text(result: RemediationResult) -> str:
    """One line for ``status.diagnosis.remediation``: what was done to each node, or why not."""
    if not result.decisions:
        return "no node named"
    return "; ".join(
        decision.message if decision.outcome is not Outcome.CORDONED else f"cordoned and tainted {decision.node}"
        for decision in result.decisions
    )
