"""``status.diagnosis`` through the real API server (its CRD's schema validates every write): what the
model writes is stored and read back unchanged, a record the operator wrote before the model is closed
key for key as before, and an attempt ended by a failed worker (no diagnosis) closes an empty one. No
operator runs here: the namespace is not one the tests' operator watches."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import kubernetes
import pytest
from trainingjobs import JOB_API, diagnosis_in, standin_job

from rankwatch.model.diagnosis_status import DiagnosisStatus, key_of
from rankwatch.operator.lifecycle.status_patch import update_status
from rankwatch.operator.recovery import attempts
from rankwatch.operator.recovery.decision import WORKER_FAILED
from rankwatch.timestamps import rfc3339_now

WRITTEN_BEFORE = {
    "active": True,
    "kind": "Straggler",
    "ranks": [5],
    "nodes": ["gpu-node-1"],
    "pods": ["llama-worker-1"],
    "confidence": 0.88,
    "summary": "rank 5 (tp 1, dp 1, pp 0) on node gpu-node-1 is 24% slower",
    "cause": "compute",
    "causeEvidence": "its kernels run 1.3x its peers'",
    "nodeAlerts": [],
    "problems": [],
    "communicator": "734abc6ba7323b2d",
    "time": "2026-11-28T10:35:36Z",
    "suspicion": "rank 5 waits least in 3 windows",
    "report": "llama-rankwatch-report",
    "remediation": "dry run: would cordon and taint gpu-node-1",
}


@pytest.fixture
def job(api: kubernetes.client.ApiClient) -> Iterator[tuple[str, str]]:
    namespace = f"rw-record-{uuid.uuid4().hex[:8]}"
    core = kubernetes.client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": namespace}})
    kubernetes.client.CustomObjectsApi(api).create_namespaced_custom_object(
        JOB_API[0], JOB_API[1], namespace, JOB_API[2], standin_job("llama")
    )
    yield namespace, "llama"
    core.delete_namespace(namespace)


def write_status(api, namespace: str, name: str, fields: dict) -> dict:
    written = update_status(namespace, name, lambda job: fields, kube=api)
    assert written is not None
    return read_status(api, namespace, name)


def read_status(api, namespace: str, name: str) -> dict:
    return kubernetes.client.CustomObjectsApi(api).get_namespaced_custom_object(
        JOB_API[0], JOB_API[1], namespace, JOB_API[2], name
    )["status"]


def test_what_the_model_writes_the_api_server_stores_and_gives_back(api, job):
    namespace, name = job
    diagnosis = DiagnosisStatus.from_record(WRITTEN_BEFORE)
    assert diagnosis is not None
    status = write_status(api, namespace, name, {"phase": "Running", **diagnosis.to_status()})
    assert diagnosis_in(status) == diagnosis.stored() == WRITTEN_BEFORE
    assert DiagnosisStatus.from_status(status) == diagnosis


def test_a_record_written_before_the_model_is_closed_by_a_restart_key_for_key(api, job):
    namespace, name = job
    status = write_status(api, namespace, name, {"phase": "Running", "diagnosis": WRITTEN_BEFORE})
    key = key_of(DiagnosisStatus.from_status(status))
    ended = attempts.EndedAttempt.of(status, "Straggler", rfc3339_now())

    assert attempts.write_restart(api, namespace, name, key, ended, [], 0, "Straggler") is not None

    status = read_status(api, namespace, name)
    resolved = diagnosis_in(status).pop("resolvedTime")
    assert diagnosis_in(status) == {**WRITTEN_BEFORE, "active": False} and resolved
    assert status["handledDiagnosis"] == key == "2026-11-28T10:35:36Z/Straggler/5"
    assert status["attempts"][0]["ranks"] == [5] and status["attempts"][0]["nodes"] == ["gpu-node-1"]


def test_an_attempt_ended_by_a_failed_worker_closes_an_empty_diagnosis(api, job):
    """No diagnosis to close: the job still reads an inactive one, resolved when the attempt ended (as
    before the model), written as the CRD accepts it (no empty kind or time)."""
    namespace, name = job
    failure = {"attempt": 0, "reason": "Error", "message": "worker 1 exited 1", "pods": ["llama-worker-1"]}
    status = write_status(api, namespace, name, {"phase": "Running", "workerFailure": failure})
    ended = attempts.EndedAttempt.of(status, WORKER_FAILED, rfc3339_now())

    assert attempts.write_restart(api, namespace, name, WORKER_FAILED, ended, [], 0, WORKER_FAILED) is not None

    status = read_status(api, namespace, name)
    diagnosis = DiagnosisStatus.from_status(status)
    assert diagnosis is not None and not diagnosis.active and diagnosis.resolved_time
    assert "kind" not in diagnosis_in(status) and "time" not in diagnosis_in(status)
    assert status["restarts"] == 1 and status["handledDiagnosis"] == "//"
