"""Where the monitor writes what it finds about one followed job, and reads back what was done.

A TrainingJob keeps it in its status (``writer.py``); a group of pods of another kind (an Indexed Job, a
JobSet...) on the object owning it (``rankwatch.operator.kinds.group_record``). The monitor runs the same
loop for both through this interface. Every method but ``remediate`` and ``alert`` blocks (the
Kubernetes client): call them in a worker thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import kubernetes

from rankwatch.model.diagnosis_status import DiagnosisStatus, FollowUp
from rankwatch.model.finding import Finding
from rankwatch.operator import api, ownership
from rankwatch.operator.config import Safeguards
from rankwatch.operator.diagnosis.diagnose.diagnose import Diagnosis
from rankwatch.operator.diagnosis.report import telemetry_watch, writer
from rankwatch.operator.remediation import hook as remediation
from rankwatch.operator.remediation.cordon import RemediationResult
from rankwatch.operator.remediation.metrics import RemediationMetrics
from rankwatch.operator.spec import TrainingJobSpec

if TYPE_CHECKING:  # alerting is imported only where alerts are sent
    from rankwatch.alerting.model import Alert


class JobRecord(Protocol):
    label: str
    """How logs name the job: ``TrainingJob team-a/llama``, ``JobSet team-a/bert``."""

    def read(self) -> dict[str, Any] | None:
        """The job with its ``status`` (``status.diagnosis`` as written), None when it is gone."""

    def pods(self) -> list[dict[str, Any]]:
        """The job's own pods (never one that merely carries its labels), not being deleted."""

    def write_telemetry_flowing(self, now: str, step_time: str | None) -> None: ...

    def write_step_time(self, step_time: str) -> None: ...

    def write_no_telemetry(self, silent: bool, message: str, now: str) -> None: ...

    def write_diagnosis(self, diagnosis: Diagnosis, now: str) -> dict[str, Any] | None:
        """Put ``diagnosis`` on the job (report, status, annotations, Event); the job as written, None
        when it already carried it (or is gone)."""

    def write_recovered(self, why: str, now: str) -> dict[str, Any] | None: ...

    def record_follow_up(self, time: str, field: FollowUp, value: str) -> bool: ...

    def stored_finding(self, time: str) -> Finding | None: ...

    def post_diagnosis_event(self, body: dict[str, Any], diagnosis: DiagnosisStatus) -> None: ...

    async def remediate(
        self, body: dict[str, Any], finding: Finding, safeguards: Safeguards, metrics: RemediationMetrics
    ) -> RemediationResult: ...

    def alert(self, finding: Finding, spec: TrainingJobSpec) -> Alert: ...

    @property
    def alert_labels(self) -> dict[str, str]:
        """The labels that pick the job's alerts (to resolve them)."""


class TrainingJobRecord:
    """A TrainingJob: its status, annotations and Events (``writer.py``), its pods by controller uid."""

    def __init__(self, kube: kubernetes.client.ApiClient, namespace: str, name: str, uid: str = "") -> None:
        self.kube, self.namespace, self.name, self.uid = kube, namespace, name, uid
        self.label = f"TrainingJob {namespace}/{name}"

    def read(self) -> dict[str, Any] | None:
        return kubernetes.client.CustomObjectsApi(self.kube).get_namespaced_custom_object(
            api.GROUP, api.VERSION, self.namespace, api.PLURAL, self.name
        )

    def pods(self) -> list[dict[str, Any]]:
        pods = kubernetes.client.CoreV1Api(self.kube).list_namespaced_pod(
            self.namespace, label_selector=f"{api.JOB_NAME_LABEL}={self.name}"
        )
        return [
            self.kube.sanitize_for_serialization(pod)
            for pod in pods.items
            if not pod.metadata.deletion_timestamp and ownership.is_owned_by(pod.metadata, self.uid)
        ]

    def write_telemetry_flowing(self, now: str, step_time: str | None) -> None:
        writer.write_telemetry_flowing(self.kube, self.namespace, self.name, now, step_time)

    def write_step_time(self, step_time: str) -> None:
        writer.write_step_time(self.kube, self.namespace, self.name, step_time)

    def write_no_telemetry(self, silent: bool, message: str, now: str) -> None:
        telemetry_watch.write(self.kube, self.namespace, self.name, silent, message, now)

    def write_diagnosis(self, diagnosis: Diagnosis, now: str) -> dict[str, Any] | None:
        return writer.write_diagnosis(self.kube, self.namespace, self.name, diagnosis, now)

    def write_recovered(self, why: str, now: str) -> dict[str, Any] | None:
        return writer.write_recovered(self.kube, self.namespace, self.name, why, now)

    def record_follow_up(self, time: str, field: FollowUp, value: str) -> bool:
        return writer.record_follow_up(self.kube, self.namespace, self.name, time, field, value)

    def stored_finding(self, time: str) -> Finding | None:
        return writer.stored_finding(self.kube, self.namespace, self.name, time)

    def post_diagnosis_event(self, body: dict[str, Any], diagnosis: DiagnosisStatus) -> None:
        writer.post_diagnosis_event(self.kube, body, diagnosis)

    async def remediate(
        self, body: dict[str, Any], finding: Finding, safeguards: Safeguards, metrics: RemediationMetrics
    ) -> RemediationResult:
        return await remediation.remediate(self.kube, body, finding, safeguards, metrics)

    def alert(self, finding: Finding, spec: TrainingJobSpec) -> Alert:
        from rankwatch.alerting import alert_from_finding

        alerting = spec.alerting
        return alert_from_finding(self.namespace, self.name, finding, alerting.route,
                                  alerting.levels.for_finding(finding.kind))  # fmt: skip

    @property
    def alert_labels(self) -> dict[str, str]:
        return {"namespace": self.namespace, "trainingjob": self.name}
