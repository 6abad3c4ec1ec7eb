"""``status.diagnosis`` read and written through one model (``rankwatch.model.diagnosis_status``): the
record the API server stores keeps its shape, what an older operator (or a job's author, in a group
owner's annotation) left reads without a crash, and reading back what was written gives it back."""

from __future__ import annotations

from pathlib import Path

import yaml

from rankwatch.analysis.findings import AnalysisReport
from rankwatch.model.diagnosis_status import DiagnosisStatus, FollowUp, key_of
from rankwatch.model.finding import Cause, Finding, FindingKind
from rankwatch.operator.diagnosis.detect.detector import suspected
from rankwatch.operator.diagnosis.diagnose.diagnose import Diagnosis, Examination
from rankwatch.operator.diagnosis.report import writer

CRD = Path(__file__).parents[2] / "crds" / "trainingjobs.rankwatch.io.yaml"

# A status.diagnosis as the operator before the model wrote it (writer.diagnosis_record), then
# followed up (remediation and alert recorded).
WRITTEN_BEFORE = {
    "active": True,
    "kind": "StuckInCollective",
    "ranks": [3, 11],
    "nodes": ["gpu-node-1", "gpu-node-4"],
    "pods": ["llama-worker-0", "llama-worker-1"],
    "confidence": 0.93,
    "summary": "ranks 3, 11 never finished AllReduce seq 812",
    "cause": "communication",
    "causeEvidence": "waits 40x the peers' on the IB link",
    "nodeAlerts": ["GPUClocksThrottled (warning) on gpu-node-1 since 2026-11-28T10:00:00Z"],
    "problems": ["sidecar llama-worker-3 did not answer"],
    "communicator": "00000000deadbeef",
    "time": "2026-11-28T10:35:36Z",
    "resolvedTime": None,
    "suspicion": "no communicator advanced for 300 s",
    "report": "llama-rankwatch-report",
    "remediation": "cordoned and tainted gpu-node-1; cordoned and tainted gpu-node-4",
    "alertedTime": "2026-11-28T10:35:40Z",
}


def crd_diagnosis_keys() -> list[str]:
    document = yaml.safe_load(CRD.read_text())
    schema = document["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return list(schema["properties"]["status"]["properties"]["diagnosis"]["properties"])


def test_a_status_written_before_the_model_reads_back_field_by_field_and_writes_the_same_record():
    diagnosis = DiagnosisStatus.from_status({"phase": "Running", "diagnosis": WRITTEN_BEFORE})
    assert diagnosis is not None
    assert (diagnosis.reason, diagnosis.kind, diagnosis.condition) == ("StuckInCollective", FindingKind.HANG, "Hung")
    assert diagnosis.ranks == (3, 11) and diagnosis.nodes == ("gpu-node-1", "gpu-node-4")
    assert diagnosis.cause is Cause.COMMUNICATION and diagnosis.active_condition == "Hung"
    assert diagnosis.pending(alerting=True) == []
    assert diagnosis.key == "2026-11-28T10:35:36Z/StuckInCollective/3,11"
    assert diagnosis.to_status() == {"diagnosis": WRITTEN_BEFORE}
    pending = DiagnosisStatus.from_record({key: value for key, value in WRITTEN_BEFORE.items() if key != "remediation"})
    assert pending is not None and pending.stored() == {k: v for k, v in WRITTEN_BEFORE.items() if v is not None
                                                          and k != "remediation"}  # fmt: skip


def test_the_record_has_exactly_the_keys_the_crd_stores():
    record = DiagnosisStatus(active=True, reason="Hang").to_record()
    assert sorted(record) == sorted(crd_diagnosis_keys())


def test_what_is_written_reads_back_unchanged():
    full = DiagnosisStatus.from_status({"diagnosis": WRITTEN_BEFORE})
    assert full is not None
    resolved = full.resolved("2026-11-28T11:00:00Z")
    bare = DiagnosisStatus(active=False, reason="Straggler")
    for diagnosis in (full, resolved, bare, full.with_follow_up(FollowUp.REMEDIATION, "dry run")):
        assert DiagnosisStatus.from_status(diagnosis.to_status()) == diagnosis
        assert DiagnosisStatus.from_record(diagnosis.to_record()) == diagnosis
    assert resolved.to_record()["active"] is False and resolved.to_record()["resolvedTime"] == "2026-11-28T11:00:00Z"


def test_a_new_diagnosis_is_written_as_before_with_its_follow_ups_pending():
    finding = Finding(
        kind=FindingKind.HANG,
        ranks=[11, 3],
        nodes=["gpu-node-4", "gpu-node-1"],
        communicator="00000000deadbeef",
        confidence=0.9312,
        summary="ranks 3, 11 never finished AllReduce seq 812",
        evidence={"stuck": True, "node_alerts": [{"text": WRITTEN_BEFORE["nodeAlerts"][0]}]},
        cause=Cause.COMMUNICATION,
        cause_evidence="waits 40x the peers' on the IB link",
    )
    suspicion = suspected(FindingKind.HANG, [3], "no communicator advanced for 300 s")
    report = AnalysisReport([finding], ["sidecar llama-worker-3 did not answer"])
    examination = Examination(report, "text", ["llama-worker-0"], 1, 500, suspicion)
    diagnosis = Diagnosis(finding, ["llama-worker-0", "llama-worker-1"], "2026-11-28T10:35:36Z", examination)

    written = writer.diagnosis_status(diagnosis, "llama-rankwatch-report")

    expected = {**WRITTEN_BEFORE, "remediation": None, "alertedTime": None}
    assert written.to_record() == expected
    assert written.pending(alerting=True) == [FollowUp.REMEDIATION, FollowUp.ALERTED]
    assert written.pending(alerting=False) == [FollowUp.REMEDIATION]
    assert writer.same_diagnosis(written, diagnosis)
    assert not writer.same_diagnosis(written.inactive(), diagnosis)


def test_an_old_or_unknown_record_reads_with_defaults_never_a_crash():
    """Written before causes, pods and problems existed; a kind this version does not know; an
    annotation a job's author edited into nonsense."""
    old = DiagnosisStatus.from_status(
        {"diagnosis": {"active": True, "kind": "Hang", "ranks": [2], "time": "2026-01-01T00:00:00Z"}}
    )
    assert old is not None and old.cause is None and old.pods == () and old.condition == "Hung"
    assert old.pending(alerting=True) == [FollowUp.REMEDIATION, FollowUp.ALERTED]

    future = DiagnosisStatus.from_record({"active": True, "kind": "ThermalRunaway", "cause": "cosmic-rays"})
    assert future is not None and future.kind is None and future.condition is None
    assert future.active_condition is None and future.cause is Cause.UNKNOWN

    hostile = DiagnosisStatus.from_record(
        {"active": "yes", "kind": 7, "ranks": "0,1", "nodes": [1, None], "confidence": "high", "time": ["x"]}
    )
    assert hostile is not None and hostile.active is False and hostile.ranks == () and hostile.confidence == 0.0
    assert hostile.nodes == ("1", "")

    for nothing in (None, {}, {"phase": "Running"}, {"diagnosis": {}}, {"diagnosis": "Hang"}):
        assert DiagnosisStatus.from_status(nothing) is None
    assert key_of(None) == "//"


def test_an_empty_kind_or_time_is_written_unset_never_as_a_value_the_crd_refuses():
    """An attempt ended by a failed worker closes a diagnosis the job may not have (before the model
    the record was ``{active: false, resolvedTime}``); read back and closed again it stays valid."""
    closed_before = {"diagnosis": {"active": False, "resolvedTime": "2026-11-28T10:00:00Z"}}
    diagnosis = DiagnosisStatus.from_status(closed_before)
    assert diagnosis is not None and diagnosis.reason == "" and diagnosis.condition is None
    record = diagnosis.resolved("2026-11-28T11:00:00Z").to_record()
    assert record["kind"] is None and record["time"] is None and record["cause"] is None
    assert record["active"] is False and record["resolvedTime"] == "2026-11-28T11:00:00Z"
    assert DiagnosisStatus.from_record(record) == diagnosis.resolved("2026-11-28T11:00:00Z")
