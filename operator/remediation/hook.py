"""The one place a new diagnosis is handed to remediation (cordon and taint the suspect nodes).

Called once per new diagnosis (not again for the same culprit after an operator restart: the job's
status says it was reported), from the operator's event loop. The job's ``spec.remediation`` and the
operator-wide safeguards decide what happens (``rankwatch.operator.remediation.cordon``); every node's
outcome is logged, and an error is logged without stopping the diagnosis from being written or
alerted.
"""

from __future__ import annotations

import logging
from typing import Any

import kubernetes

from rankwatch.operator.diagnosis.diagnose import Diagnosis
from rankwatch.operator.remediation.cordon import RemediationResult, remediate_async
from rankwatch.operator.remediation.cordon_decision import RemediationPolicy, Suspicion
from rankwatch.operator.spec import TrainingJobSpec

log = logging.getLogger(__name__)


def suspicion_of(job: dict[str, Any], diagnosis: Diagnosis) -> Suspicion:
    """The diagnosis as remediation reads it: the finding's kind, the Kubernetes nodes it blames."""
    metadata = job["metadata"]
    finding = diagnosis.finding
    return Suspicion(
        job_namespace=metadata["namespace"],
        job_name=metadata["name"],
        job_uid=metadata.get("uid", ""),
        kind=str(finding.get("kind", "")),
        nodes=tuple(diagnosis.nodes),
        ranks=tuple(diagnosis.ranks),
        confidence=float(diagnosis.confidence),
        summary=diagnosis.summary,
        evidence=dict(finding.get("evidence") or {}),
    )


async def remediate(job: dict[str, Any], diagnosis: Diagnosis) -> RemediationResult | None:
    name = f"{job['metadata']['namespace']}/{job['metadata']['name']}"
    try:
        spec = TrainingJobSpec.from_manifest(dict(job.get("spec") or {}))
        policy = RemediationPolicy.for_job(spec.remediation)
        result = await remediate_async(kubernetes.client.ApiClient(), suspicion_of(job, diagnosis), policy)
    except Exception:
        log.exception("remediation of TrainingJob %s (%s on %s) failed", name, diagnosis.kind, diagnosis.nodes)
        return None
    for decision in result.decisions:
        log.info("TrainingJob %s: node %s: %s (%s)", name, decision.node, decision.outcome.value, decision.message)
    return result
