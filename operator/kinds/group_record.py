"""Where a group of another kind keeps its diagnosis: on the object owning it (the Job, the JobSet...),
where that kind's users look, since rankwatch owns no object of its own for it.

- the annotation ``rankwatch.io/diagnosis``: the diagnosis as JSON, the same record a TrainingJob keeps
  in ``status.diagnosis`` (what, who, where, how sure, the report's ConfigMap, which follow-ups are
  done), so a new leader neither repeats nor loses a cordon or an alert;
- the annotations ``rankwatch.io/suspect-nodes`` / ``suspect-ranks`` / ``health`` / ``step-time``;
- a Warning Event on the owner named after the diagnosis, and ``Recovered`` / ``NoTelemetry`` Events;
- the full report in a ConfigMap the owner owns (deleted with it).

The owner's annotations are writable by the job's author too: what is read back is checked, and a
record that does not parse counts as none (logged), never as a crash. Writes of the record carry the
owner's resourceVersion: a concurrent change means read again, never overwrite.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch.model import event_reasons
from rankwatch.model.diagnosis_status import DiagnosisStatus, FollowUp
from rankwatch.model.finding import Finding
from rankwatch.operator import api, events
from rankwatch.operator.config import Safeguards
from rankwatch.operator.diagnosis.diagnose.diagnose import Diagnosis
from rankwatch.operator.diagnosis.report import writer
from rankwatch.operator.kinds.adapter import Group, KindAdapter, read_owner
from rankwatch.operator.remediation import hook as remediation
from rankwatch.operator.remediation.cordon import RemediationResult
from rankwatch.operator.remediation.metrics import RemediationMetrics
from rankwatch.operator.spec import Remediation, TrainingJobSpec

if TYPE_CHECKING:
    from rankwatch.alerting.model import Alert

log = logging.getLogger(__name__)

HEALTH_ANNOTATION = "rankwatch.io/health"
STEP_TIME_ANNOTATION = "rankwatch.io/step-time"
ATTEMPTS = 5


def report_name(group: Group) -> str:
    """The report ConfigMap's name: never a TrainingJob's (``<name>-rankwatch-report``) nor another kind's."""
    return f"{group.name}-rankwatch-{group.kind_key.lower()}-report"


def _json(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":"), default=str)


def diagnosis_of(owner: dict[str, Any]) -> DiagnosisStatus | None:
    """The diagnosis the owner carries, None when none (or one that does not parse)."""
    text = ((owner.get("metadata") or {}).get("annotations") or {}).get(api.DIAGNOSIS_ANNOTATION)
    if not text:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    diagnosis = DiagnosisStatus.from_record(record)
    if diagnosis is None or not isinstance(record.get("time"), str):
        metadata = owner.get("metadata") or {}
        log.warning("%s/%s: annotation %s is not a diagnosis rankwatch wrote; ignored", metadata.get("namespace"),
                    metadata.get("name"), api.DIAGNOSIS_ANNOTATION)  # fmt: skip
        return None
    return diagnosis


def _status(diagnosis: DiagnosisStatus | None) -> dict[str, Any]:
    """The owner's diagnosis as a TrainingJob's status would carry it (what the monitor reads)."""
    return diagnosis.to_status() if diagnosis else {}


class GroupRecord:
    def __init__(
        self, kube: kubernetes.client.ApiClient, adapter: KindAdapter, group: Group, remediation: Remediation
    ) -> None:
        self.kube, self.adapter, self.group, self.remediation = kube, adapter, group, remediation
        self.label = str(group)
        self.after_remediation: Callable[[], None] | None = None
        """Called once a cordon was decided: the group's restart looks next (``restart.py``)."""

    # -- reading -------------------------------------------------------------------------------------
    def read(self) -> dict[str, Any] | None:
        owner = read_owner(self.kube, self.group)
        return None if owner is None else {**owner, "status": _status(diagnosis_of(owner))}

    def pods(self) -> list[dict[str, Any]]:
        return self.adapter.member_pods(self.kube, self.group)

    def stored_finding(self, time: str) -> Finding | None:
        return writer.stored_finding(self.kube, self.group.namespace, self.group.name, time, report_name(self.group))

    # -- writing -------------------------------------------------------------------------------------
    def _update(self, change: Callable[[dict[str, Any]], dict[str, str | None] | None]) -> dict[str, Any] | None:
        """Apply ``change`` (owner -> annotations to set, None: nothing to do) conditionally on the owner's
        resourceVersion; the owner as written, None when nothing was written (or it is gone)."""
        api_group, _, version = self.group.api_version.rpartition("/")
        objects = kubernetes.client.CustomObjectsApi(self.kube)
        for _attempt in range(ATTEMPTS):
            owner = read_owner(self.kube, self.group)
            if owner is None:
                return None
            annotations = change(owner)
            if annotations is None:
                return None
            patch = {"metadata": {"annotations": annotations, "resourceVersion": owner["metadata"]["resourceVersion"]}}
            try:
                return objects.patch_namespaced_custom_object(
                    api_group, version, self.group.namespace, self.group.plural, self.group.name, patch
                )
            except ApiException as error:
                if error.status == 404:
                    return None
                if error.status != 409:
                    raise
        raise RuntimeError(f"{self.group}: changed {ATTEMPTS} times while rankwatch wrote its diagnosis; retrying")

    def _annotate(self, annotations: dict[str, str | None]) -> None:
        self._update(lambda owner: annotations)

    def write_telemetry_flowing(self, now: str, step_time: str | None) -> None:
        """The step time; and Healthy where a restart left the health Unknown (its new attempt reports)."""

        def change(owner: dict[str, Any]) -> dict[str, str | None] | None:
            annotations = (owner.get("metadata") or {}).get("annotations") or {}
            fields = {STEP_TIME_ANNOTATION: step_time} if step_time else {}
            diagnosis = diagnosis_of(owner)
            if annotations.get(HEALTH_ANNOTATION) == "Unknown" and not (diagnosis and diagnosis.active):
                fields[HEALTH_ANNOTATION] = "Healthy"
            return fields or None

        self._update(change)

    def write_step_time(self, step_time: str) -> None:
        self._annotate({STEP_TIME_ANNOTATION: step_time})

    def write_no_telemetry(self, silent: bool, message: str, now: str) -> None:
        text = message if silent else "window summaries arrive from the sidecars again"
        reason = event_reasons.NO_TELEMETRY if silent else event_reasons.TELEMETRY_RESUMED
        self._post("Warning" if silent else "Normal", reason, text,
                   f"NoTelemetry/{silent}/{now}")  # fmt: skip

    def write_diagnosis(self, diagnosis: Diagnosis, now: str) -> dict[str, Any] | None:
        owner = read_owner(self.kube, self.group)
        if owner is None or writer.same_diagnosis(diagnosis_of(owner), diagnosis):
            return None
        name = writer.store_report(self.kube, owner, diagnosis, report_name(self.group), self.group.owner_reference)
        record = writer.diagnosis_status(diagnosis, name)

        def change(owner: dict[str, Any]) -> dict[str, str | None] | None:
            if writer.same_diagnosis(diagnosis_of(owner), diagnosis):
                return None
            return {
                api.DIAGNOSIS_ANNOTATION: _json(record.to_record()),
                HEALTH_ANNOTATION: diagnosis.finding.condition,
                **writer.suspect_annotations(diagnosis.finding),
            }

        written = self._update(change)
        if written is None:
            return None
        body = {**written, "status": record.to_status()}
        self.post_diagnosis_event(body, record)
        return body

    def post_diagnosis_event(self, body: dict[str, Any], diagnosis: DiagnosisStatus) -> None:
        writer.post_diagnosis_event(self.kube, body, diagnosis, self.group.event_target)

    def record_follow_up(self, time: str, field: FollowUp, value: str) -> bool:
        def change(owner: dict[str, Any]) -> dict[str, str | None] | None:
            record = diagnosis_of(owner)
            if record is None or record.time != time or record.follow_up_done(field):
                return None
            return {api.DIAGNOSIS_ANNOTATION: _json(record.with_follow_up(field, value).to_record())}

        return self._update(change) is not None

    def claim_restart(self, time: str, value: str) -> bool:
        """Write ``value`` as the restart of the diagnosis written at ``time`` unless one is written:
        one restart look per diagnosis, whichever replica or leader makes it."""

        def change(owner: dict[str, Any]) -> dict[str, str | None] | None:
            record = diagnosis_of(owner)
            if record is None or record.time != time or record.restart:
                return None
            return {api.DIAGNOSIS_ANNOTATION: _json(record.with_restart(value).to_record())}

        return self._update(change) is not None

    def settle_restart(self, time: str, outcome: str, closed: bool) -> bool:
        """Replace the claimed restart of the diagnosis written at ``time`` with its ``outcome``; ``closed``:
        the group restarted, so the finding is no longer active (its next attempt starts clean)."""

        def change(owner: dict[str, Any]) -> dict[str, str | None] | None:
            record = diagnosis_of(owner)
            if record is None or record.time != time:
                return None
            if not closed:
                return {api.DIAGNOSIS_ANNOTATION: _json(record.with_restart(outcome).to_record())}
            now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
            return {
                api.DIAGNOSIS_ANNOTATION: _json(record.with_restart(outcome).resolved(now).to_record()),
                HEALTH_ANNOTATION: "Unknown",
                writer.SUSPECT_NODES_ANNOTATION: None,
                writer.SUSPECT_RANKS_ANNOTATION: None,
            }

        return self._update(change) is not None

    def write_recovered(self, why: str, now: str) -> dict[str, Any] | None:
        previous: list[DiagnosisStatus] = []

        def change(owner: dict[str, Any]) -> dict[str, str | None] | None:
            record = diagnosis_of(owner)
            if record is None or not record.active:
                return None
            previous[:] = [record]
            return {
                api.DIAGNOSIS_ANNOTATION: _json(record.resolved(now).to_record()),
                HEALTH_ANNOTATION: "Healthy",
                writer.SUSPECT_NODES_ANNOTATION: None,
                writer.SUSPECT_RANKS_ANNOTATION: None,
            }

        written = self._update(change)
        if written is None:
            return None
        cleared = previous[0] if previous else None
        self._post("Normal", event_reasons.RECOVERED, writer.recovered_message(cleared, why),
                   writer.recovered_key(cleared))  # fmt: skip
        return written

    def _post(self, type_: str, reason: str, message: str, key: str) -> None:
        try:
            events.post_event(self.kube, self.group.event_target, type=type_, reason=reason, message=message, key=key,
                              repeat=False, now=datetime.datetime.now(datetime.UTC))  # fmt: skip
        except ApiException as error:
            log.warning("Event %s on %s not posted: HTTP %s", reason, self.group, error.status)

    # -- follow-ups ----------------------------------------------------------------------------------
    async def remediate(
        self, body: dict[str, Any], finding: Finding, safeguards: Safeguards, metrics: RemediationMetrics
    ) -> RemediationResult:
        pods = await asyncio.to_thread(self.pods)
        nodes = frozenset(pod["spec"]["nodeName"] for pod in pods if (pod.get("spec") or {}).get("nodeName"))
        written = DiagnosisStatus.from_status(body.get("status"))
        diagnosis = written.time if written else ""
        result = await remediation.remediate_group(
            self.kube, self.group, nodes, finding, diagnosis, self.remediation, safeguards, metrics
        )
        if self.after_remediation is not None:
            self.after_remediation()
        return result

    def alert(self, finding: Finding, spec: TrainingJobSpec) -> Alert:
        from rankwatch.alerting import alert_from_finding

        alerting = spec.alerting
        return alert_from_finding(self.group.namespace, self.group.name, finding, alerting.route,
                                  alerting.levels.for_finding(finding.kind), job_kind=self.group.kind_key)  # fmt: skip

    @property
    def alert_labels(self) -> dict[str, str]:
        return {"namespace": self.group.namespace, "trainingjob": self.group.name, "jobkind": self.group.kind_key}
