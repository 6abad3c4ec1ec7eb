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

from rankwatch.analysis.findings import Finding
from rankwatch.operator import api, events
from rankwatch.operator.config import Safeguards
from rankwatch.operator.diagnosis import writer
from rankwatch.operator.diagnosis.diagnose import Diagnosis
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


def diagnosis_of(owner: dict[str, Any]) -> dict[str, Any]:
    """The diagnosis record the owner carries, {} when none (or one that does not parse)."""
    text = ((owner.get("metadata") or {}).get("annotations") or {}).get(api.DIAGNOSIS_ANNOTATION)
    if not text:
        return {}
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("time"), str):
        metadata = owner.get("metadata") or {}
        log.warning("%s/%s: annotation %s is not a diagnosis rankwatch wrote; ignored", metadata.get("namespace"),
                    metadata.get("name"), api.DIAGNOSIS_ANNOTATION)  # fmt: skip
        return {}
    return record


class GroupRecord:
    def __init__(
        self, kube: kubernetes.client.ApiClient, adapter: KindAdapter, group: Group, remediation: Remediation
    ) -> None:
        self.kube, self.adapter, self.group, self.remediation = kube, adapter, group, remediation
        self.label = str(group)

    # -- reading -------------------------------------------------------------------------------------
    def read(self) -> dict[str, Any] | None:
        owner = read_owner(self.kube, self.group)
        return None if owner is None else {**owner, "status": {"diagnosis": diagnosis_of(owner)}}

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
        if step_time:
            self.write_step_time(step_time)

    def write_step_time(self, step_time: str) -> None:
        self._annotate({STEP_TIME_ANNOTATION: step_time})

    def write_no_telemetry(self, silent: bool, message: str, now: str) -> None:
        text = message if silent else "window summaries arrive from the sidecars again"
        self._post("Warning" if silent else "Normal", "NoTelemetry" if silent else "TelemetryResumed", text,
                   f"NoTelemetry/{silent}/{now}")  # fmt: skip

    def write_diagnosis(self, diagnosis: Diagnosis, now: str) -> dict[str, Any] | None:
        owner = read_owner(self.kube, self.group)
        if owner is None or writer.same_diagnosis(diagnosis_of(owner), diagnosis):
            return None
        name = writer.store_report(self.kube, owner, diagnosis, report_name(self.group), self.group.owner_reference)
        record = writer.diagnosis_record(diagnosis, name)

        def change(owner: dict[str, Any]) -> dict[str, str | None] | None:
            if writer.same_diagnosis(diagnosis_of(owner), diagnosis):
                return None
            return {
                api.DIAGNOSIS_ANNOTATION: _json(record),
                HEALTH_ANNOTATION: diagnosis.condition,
                writer.SUSPECT_NODES_ANNOTATION: writer.listed(diagnosis.nodes),
                writer.SUSPECT_RANKS_ANNOTATION: writer.listed(diagnosis.ranks),
            }

        written = self._update(change)
        if written is None:
            return None
        body = {**written, "status": {"diagnosis": record}}
        self.post_diagnosis_event(body, record)
        return body

    def post_diagnosis_event(self, body: dict[str, Any], diagnosis: dict[str, Any]) -> None:
        writer.post_diagnosis_event(self.kube, body, diagnosis, self.group.event_target)

    def record_follow_up(self, time: str, field: str, value: str) -> bool:
        def change(owner: dict[str, Any]) -> dict[str, str | None] | None:
            record = diagnosis_of(owner)
            if record.get("time") != time or record.get(field):
                return None
            return {api.DIAGNOSIS_ANNOTATION: _json({**record, field: value})}

        return self._update(change) is not None

    def write_recovered(self, why: str, now: str) -> dict[str, Any] | None:
        previous: dict[str, Any] = {}

        def change(owner: dict[str, Any]) -> dict[str, str | None] | None:
            record = diagnosis_of(owner)
            if not record.get("active"):
                return None
            previous.clear()
            previous.update(record)
            return {
                api.DIAGNOSIS_ANNOTATION: _json({**record, "active": False, "resolvedTime": now}),
                HEALTH_ANNOTATION: "Healthy",
                writer.SUSPECT_NODES_ANNOTATION: None,
                writer.SUSPECT_RANKS_ANNOTATION: None,
            }

        written = self._update(change)
        if written is None:
            return None
        self._post("Normal", "Recovered",
                   f"{previous.get('kind', 'finding')} cleared: {why} (was: {previous.get('summary', '')})",
                   f"recovered/{previous.get('kind')}/{previous.get('time')}")  # fmt: skip
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
        diagnosis = ((body.get("status") or {}).get("diagnosis") or {}).get("time", "")
        return await remediation.remediate_group(
            self.kube, self.group, nodes, finding, diagnosis, self.remediation, safeguards, metrics
        )

    def alert(self, finding: Finding, spec: TrainingJobSpec) -> Alert:
        from rankwatch.alerting import alert_from_finding

        return alert_from_finding(self.group.namespace, self.group.name, finding, spec.alerting,
                                  job_kind=self.group.kind_key)  # fmt: skip

    @property
    def alert_labels(self) -> dict[str, str]:
        return {"namespace": self.group.namespace, "trainingjob": self.group.name, "jobkind": self.group.kind_key}
