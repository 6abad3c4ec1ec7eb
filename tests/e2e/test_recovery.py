"""Recovery end to end: a hung attempt is archived to a real S3-compatible server (MinIO, built from its
Go module, on loopback), ended, and the job restarted on other nodes; the restart limit, dry run and an
open circuit breaker. Real operator, real sidecars and interposer, pods run by the pod runner."""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time

import kubernetes
import pytest
from trainingjobs import (
    ARMED_RUNS,
    SENSITIVITY,
    condition,
    create_job,
    diagnosis_in,
    events,
    get_job,
    judge,
    report,
    standin_job,
    stored_diagnosis,
)

pytestmark = pytest.mark.e2e

BUCKET = "rankwatch-evidence"
HANG_RANK = 2  # on worker 0
TARGET_S = SENSITIVITY + 30  # hang onset -> every worker Running again


@pytest.fixture(scope="module")
def s3(tmp_path_factory, operator):
    """MinIO on loopback with one bucket; yields the server (endpoint and credentials)."""
    from rankwatch.analysis.archive import s3_client
    from rankwatch.cluster.s3_server import S3Server

    # On the port the session operator allows as its archive endpoint (conftest.py).
    port = int(os.environ["RANKWATCH_ARCHIVE_ENDPOINTS"].rsplit(":", 1)[1])
    with S3Server(tmp_path_factory.mktemp("minio"), port=port) as server:
        s3_client(server.endpoint, "us-east-1", server.access_key, server.secret_key).create_bucket(Bucket=BUCKET)
        yield server


@pytest.fixture
def s3_secret(api, namespace, s3):
    kubernetes.client.CoreV1Api(api).create_namespaced_secret(
        namespace,
        {
            "metadata": {"name": "evidence-bucket", "labels": {"rankwatch.io/archive-credentials": "true"}},
            "stringData": {"accessKeyId": s3.access_key, "secretAccessKey": s3.secret_key},
        },
    )
    return {
        "s3": {"bucket": BUCKET, "endpoint": s3.endpoint, "prefix": "e2e", "secretRef": {"name": "evidence-bucket"}}
    }


@pytest.fixture
def safeguards(api, namespace, monkeypatch):
    """Whatever the test's jobs got cordoned is undone afterwards, so later tests have all four nodes
    (the session operator runs with cordons allowed back to back: see conftest.py)."""
    from rankwatch.operator.remediation.cordon import uncordon_job

    yield monkeypatch
    for name in ("hang", "limit", "dry", "breaker", "far"):
        uncordon_job(api, namespace, name, via="test")


def recovering_job(name: str, recovery: dict, faults: dict[str, str], **tracing) -> dict:
    manifest = standin_job(name, faults, remediation={"cordon": True, "maxNodesPerJob": 2})
    manifest["spec"]["recovery"] = recovery
    manifest["spec"]["tracing"].update(tracing)
    return manifest


def hang_faults(only_first_attempt: bool) -> dict[str, str]:
    faults = {"RANKWATCH_STANDIN_FAULT_RANK": str(HANG_RANK), "RANKWATCH_STANDIN_HANG_BEFORE_CALL": "300"}
    if only_first_attempt:  # the fault stays with the attempt (as a bad GPU stays with its node)
        faults["RANKWATCH_STANDIN_FAULT_ATTEMPT"] = "0"
    return faults


def pods_of(api, namespace: str, job: str, attempt: int) -> list:
    selector = f"rankwatch.io/job-name={job},rankwatch.io/attempt={attempt}"
    return kubernetes.client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector).items


def wait_hung(api, namespace: str, name: str, eventually, attempt: int = 0) -> dict:
    """The job once ``attempt`` was diagnosed hung. With no backoff Hung=True lasts only until the
    restart is written, so an attempt already ended for its hang counts too (its diagnosis stays in
    the status, inactive, until the next attempt finds something)."""

    def hung():
        job = get_job(api, namespace, name)
        status = job.get("status", {})
        if int(status.get("restarts") or 0) == attempt and condition(job, "Hung").get("status") == "True":
            return job
        ended = [a for a in status.get("attempts") or [] if a.get("attempt") == attempt]
        return job if ended and ended[0].get("reason") == "Hang" and diagnosis_in(status) else None

    return eventually(hung, 150, interval=0.5, what=f"Hung=True in attempt {attempt}")


def wall(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def test_hung_rank_restarts_the_job_on_other_nodes_with_its_evidence_archived(
    api, kubectl, namespace, pod_runner, eventually, safeguards, s3, s3_secret, tmp_path, collector_url
):
    manifest = recovering_job("hang", {"maxRestarts": 2, "backoffSeconds": 0}, hang_faults(True), archive=s3_secret)
    create_job(api, namespace, manifest)

    # attempt 0's pods, named before the hang: with no backoff the restart may delete them at once
    def attempt_0_pods() -> set[str] | None:
        names = {pod.metadata.name for pod in pods_of(api, namespace, "hang", 0)}
        return names if len(names) == manifest["spec"]["replicas"] else None

    first_pods = eventually(attempt_0_pods, 60, what="attempt 0's pods")
    job = wait_hung(api, namespace, "hang", eventually)
    diagnosis = stored_diagnosis(job)
    assert diagnosis["kind"] == "Hang" and diagnosis["ranks"] == [HANG_RANK], diagnosis
    [node] = diagnosis["nodes"]
    finding = report(api, namespace, job)["findings"][0]
    onset = wall(diagnosis["time"]) - finding["evidence"]["waiting_seconds"]

    # the next attempt runs, every worker on another node
    def running_again():
        job = get_job(api, namespace, "hang")
        status = job.get("status", {})
        return job if status.get("restarts") == 1 and status.get("phase") == "Running" else None

    job = eventually(running_again, TARGET_S + 60, interval=0.5, what="attempt 1 Running")
    back_after = time.time() - onset
    second = pods_of(api, namespace, "hang", 1)
    assert len(second) == 2 and all(pod.spec.node_name and pod.spec.node_name != node for pod in second), [
        (pod.metadata.name, pod.spec.node_name) for pod in second
    ]
    assert {pod.metadata.name for pod in second} == {"hang-r1-worker-0", "hang-r1-worker-1"}
    assert kubernetes.client.CoreV1Api(api).read_node(node).spec.unschedulable, "the suspect node is cordoned"
    eventually(
        lambda: (
            not [
                p
                for p in kubernetes.client.CoreV1Api(api).list_namespaced_pod(namespace).items
                if p.metadata.name in first_pods
            ]
        ),
        30,
        what="attempt 0's pods gone",
    )

    status = job["status"]
    [ended] = status["attempts"]
    assert (ended["attempt"], ended["reason"], ended["ranks"], ended["nodes"]) == (0, "Hang", [HANG_RANK], [node])
    assert ended["archive"].startswith(f"s3://{BUCKET}/e2e/{namespace}/hang/"), ended
    assert condition(job, "Restarting")["status"] == "False" and diagnosis_in(status)["active"] is False
    reasons = [e.reason for e in events(api, namespace, "hang")]
    assert "Restarting" in reasons, reasons
    assert "evidence-bucket" not in json.dumps(status).replace(
        '"evidence-bucket"', ""
    ) and s3.secret_key not in json.dumps(status)

    # the new attempt is healthy: telemetry flows, nothing is found while the detector judges it armed
    eventually(
        lambda: condition(get_job(api, namespace, "hang"), "Hung").get("reason") == "TelemetryHealthy",
        60,
        what="attempt 1's telemetry",
    )

    def still_healthy() -> None:
        job = get_job(api, namespace, "hang")
        assert job["status"]["restarts"] == 1 and job["status"]["phase"] == "Running"
        assert condition(job, "Hung")["status"] == "False" and stored_diagnosis(job)["active"] is False

    metrics = f"{collector_url}/metrics"
    judge(metrics, namespace, ("hang",), still_healthy, eventually, ARMED_RUNS)

    # the archive holds every rank's trace, and `rankwatch analyze` on it names the same culprit
    from rankwatch.analysis.archive import download, s3_client
    from rankwatch.analysis.load import load_path

    client = s3_client(s3.endpoint, "us-east-1", s3.access_key, s3.secret_key)
    local = download(ended["archive"], tmp_path / "archive", client)
    manifest_file = json.loads((local / "manifest.json").read_text())
    assert manifest_file["attempt"] == 0 and set(manifest_file["pods"]) == first_pods
    assert sorted(load_path(local / "rings").ranks) == list(range(8)), "every rank's ring window"
    assert (local / "report.html").read_text().lower().startswith("<!doctype html>")
    assert json.loads((local / "timeline.json").read_text())["traceEvents"]
    assert list(local.glob("files/hang-worker-0/megatrace/rank_*.log")), "the stall watch's Megatrace logs"
    assert json.loads((local / "diagnosis.json").read_text())["findings"][0]["ranks"] == [HANG_RANK]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
    result = subprocess.run(
        [sys.executable, "-m", "rankwatch", "analyze", ended["archive"], "--s3-endpoint", s3.endpoint,
         "--json", str(tmp_path / "again.json")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    again = json.loads((tmp_path / "again.json").read_text())["findings"][0]
    assert (again["kind"], again["ranks"], again["nodes"]) == ("hang", [HANG_RANK], [node]), result.stdout
    print(  # the operator's KopfRunner holds sys.stdout while it runs
        f"hang onset -> every worker Running again on other nodes: {back_after:.1f} s "
        f"(target sensitivity + 30 = {TARGET_S} s); evidence at {ended['archive']}",
        file=sys.__stdout__,
    )
    assert back_after <= TARGET_S + 15, f"{back_after:.1f} s from hang onset to Running again"


def test_restart_limit_fails_the_job_naming_every_attempts_culprits(api, namespace, pod_runner, eventually, safeguards):
    create_job(api, namespace, recovering_job("limit", {"maxRestarts": 1, "backoffSeconds": 0}, hang_faults(False)))

    # With no backoff, Hung=True of an attempt lasts only until the restart is written: the attempt
    # records are what stays, so the test reads those (as a user reading the status later would).
    def failed():
        job = get_job(api, namespace, "limit")
        return job if job.get("status", {}).get("phase") == "Failed" else None

    job = eventually(failed, 300, what="Failed after the restart limit")
    status = job["status"]
    assert condition(job, "Failed")["reason"] == "RestartLimitReached"
    assert [(a["attempt"], a["reason"], a["ranks"]) for a in status["attempts"]] == [
        (0, "Hang", [HANG_RANK]),
        (1, "Hang", [HANG_RANK]),
    ], status["attempts"]
    first, second = (a["nodes"] for a in status["attempts"])
    assert len(first) == 1 and len(second) == 1 and first != second, "attempt 1 ran away from attempt 0's suspect"
    assert f"attempt 0: Hang, rank(s) {HANG_RANK} on {first[0]}" in status["message"], status["message"]
    assert f"attempt 1: Hang, rank(s) {HANG_RANK} on {second[0]}" in status["message"], status["message"]
    eventually(lambda: not pods_of(api, namespace, "limit", 1), 30, what="the last attempt's pods ended")
    # The Event follows the pods' end (the operator ends them, then says so).
    eventually(lambda: "RestartLimitReached" in [e.reason for e in events(api, namespace, "limit")], 20, what="Event")


def test_dry_run_restarts_nothing_but_writes_and_archives_everything(
    api, namespace, pod_runner, eventually, safeguards, s3_secret
):
    manifest = recovering_job("dry", {"backoffSeconds": 0}, hang_faults(True), archive=s3_secret)
    manifest["spec"]["remediation"]["dryRun"] = True
    create_job(api, namespace, manifest)
    job = wait_hung(api, namespace, "dry", eventually)
    [node] = stored_diagnosis(job)["nodes"]
    job = eventually(
        lambda: (j := get_job(api, namespace, "dry")) and j["status"].get("archives") and j,
        60,
        what="the evidence archived",
    )
    [kept] = job["status"]["archives"]
    assert kept["attempt"] == 0 and kept["reason"] == "Hang" and kept["path"].startswith(f"s3://{BUCKET}/"), kept
    eventually(lambda: "RestartSkipped" in [e.reason for e in events(api, namespace, "dry")], 20, what="the Event")
    time.sleep(5)
    job = get_job(api, namespace, "dry")
    assert not job["status"].get("restarts") and condition(job, "Hung")["status"] == "True"
    assert len(pods_of(api, namespace, "dry", 0)) == 2 and not pods_of(api, namespace, "dry", 1)
    node_object = kubernetes.client.CoreV1Api(api).read_node(node)
    assert not node_object.spec.unschedulable
    assert node_object.metadata.annotations.get("rankwatch.io/dry-run") == "true"


def test_an_archive_endpoint_the_admin_did_not_list_is_refused_before_any_connection(
    api, namespace, pod_runner, eventually, safeguards, s3_secret
):
    """A job naming a host:port of its choosing: no signed PUT, no port probe, a clear problem instead."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0)
        far = f"http://127.0.0.1:{listener.getsockname()[1]}"
        archive = {"s3": {**s3_secret["s3"], "endpoint": far}}
        manifest = recovering_job("far", {"backoffSeconds": 0}, hang_faults(True), archive=archive)
        manifest["spec"]["remediation"]["dryRun"] = True
        create_job(api, namespace, manifest)
        wait_hung(api, namespace, "far", eventually)
        job = eventually(
            lambda: (j := get_job(api, namespace, "far")) and j["status"].get("archives") and j,
            60,
            what="the archive's outcome",
        )
        [entry] = job["status"]["archives"]
        assert entry["path"] == "" and f"{far} is not one of the operator's archive endpoints" in entry["problems"][0]
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    # the Event follows the status write
    eventually(lambda: "EvidenceNotKept" in [e.reason for e in events(api, namespace, "far")], 30,
               what="the EvidenceNotKept Event")  # fmt: skip


def test_with_the_breaker_open_the_restart_avoids_the_suspect_by_node_affinity(
    api, kubeconfig, unwatched_namespace, processes, eventually, tmp_path
):
    # The operator reads its safeguards once, at start: an operator of this test's own, whose circuit
    # breaker allows no cordon at all.
    namespace, port = unwatched_namespace, processes.free_port()
    no_cordon_allowed = {"RANKWATCH_BREAKER_MAX_SHARE": "0", "RANKWATCH_BREAKER_MIN_NODES": "0"}
    operator = processes.operator(kubeconfig, namespace, tmp_path / "operator.log", port, no_cordon_allowed)
    runner = processes.pod_runner(kubeconfig, f"http://127.0.0.1:{port}", namespace, tmp_path / "pods")
    try:
        _breaker_open_restart(api, namespace, eventually)
    finally:
        processes.stop(runner)
        processes.stop(operator)


def _breaker_open_restart(api, namespace: str, eventually) -> None:
    create_job(api, namespace, recovering_job("breaker", {"backoffSeconds": 0}, hang_faults(True)))

    # With nothing to cordon or archive, attempt 0 ends within a second of its diagnosis: read the
    # suspect from the ended attempt's record rather than race to see Hung=True.
    def ended() -> list | None:
        attempts = get_job(api, namespace, "breaker").get("status", {}).get("attempts") or []
        return attempts[0]["nodes"] if attempts and attempts[0].get("reason") == "Hang" else None

    [node] = eventually(ended, 150, interval=0.5, what="attempt 0 ended by its hang")

    def restarted():
        pods = pods_of(api, namespace, "breaker", 1)
        return pods if len(pods) == 2 and all(pod.spec.node_name for pod in pods) else None

    pods = eventually(restarted, 60, what="attempt 1 scheduled")
    assert not kubernetes.client.CoreV1Api(api).read_node(node).spec.unschedulable, "the breaker kept it"
    assert get_job(api, namespace, "breaker")["status"]["avoidNodes"] == [node]
    for pod in pods:
        assert pod.spec.node_name != node
        terms = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
        assert [(f.key, f.operator, f.values) for f in terms[0].match_fields] == [("metadata.name", "NotIn", [node])]
    assert "CircuitBreakerOpen" in [e.reason for e in events(api, namespace, "breaker")]
