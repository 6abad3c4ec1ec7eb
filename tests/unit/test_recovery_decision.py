"""What recovery decides for a job's status (no cluster): restart, fail at the limit, say only, wait."""

from __future__ import annotations

import datetime

import pytest

from rankwatch.model.diagnosis_status import DiagnosisStatus
from rankwatch.operator.recovery.decision import Action, culprits_text, decide
from rankwatch.operator.spec import TrainingJobSpec

NOW = datetime.datetime(2026, 5, 1, 12, 0, 0, tzinfo=datetime.UTC)


def spec(recovery=None, remediation=None, archive=False) -> TrainingJobSpec:
    manifest = {"template": {}, "recovery": recovery or {}, "remediation": remediation or {}}
    if archive:
        manifest["tracing"] = {"archive": {"s3": {"bucket": "traces", "secretRef": {"name": "s3"}}}}
    return TrainingJobSpec.from_manifest(manifest)


def status(kind="Hang", active=True, restarts=0, phase="Running", **more) -> dict:
    diagnosis = {"active": active, "kind": kind, "ranks": [2], "nodes": ["gpu-1"], "time": "2026-05-01T11:59:50Z"}
    return {"phase": phase, "restarts": restarts, "diagnosis": diagnosis, **more}


def test_a_confirmed_hang_restarts_by_default_until_the_limit_then_fails():
    assert decide(spec(), status(), NOW).action is Action.RESTART
    assert decide(spec(), status(kind="StuckInCollective", restarts=2), NOW).action is Action.RESTART
    verdict = decide(spec(), status(restarts=3), NOW)
    assert verdict.action is Action.FAIL and "3 restart(s) of at most 3" in verdict.message
    assert decide(spec({"maxRestarts": 0}), status(), NOW).action is Action.FAIL


def test_a_straggler_only_cordons_unless_its_slowdown_passes_the_threshold():
    assert decide(spec(), status(kind="Straggler"), NOW, slowdown=5.0).action is Action.NOTHING
    threshold = spec({"restartOn": {"slowdownAbove": 0.5}})
    assert decide(threshold, status(kind="Straggler"), NOW, slowdown=0.6).action is Action.RESTART
    assert decide(threshold, status(kind="FailSlow"), NOW, slowdown=0.4).action is Action.NOTHING
    assert decide(threshold, status(kind="Straggler"), NOW, slowdown=None).action is Action.NOTHING
    assert decide(threshold, status(kind="SlowLink"), NOW, slowdown=0.9).action is Action.NOTHING
    assert decide(spec({"restartOn": {"hang": False}}), status(), NOW).action is Action.NOTHING


def test_dry_run_and_policy_none_only_record_and_a_handled_finding_is_left_alone():
    dry = decide(spec(remediation={"dryRun": True}), status(), NOW)
    assert dry.action is Action.RECORD and dry.message.startswith("dry run: would end attempt 0")
    assert decide(spec({"policy": "None"}), status(), NOW).action is Action.RECORD
    handled = status(handledDiagnosis=DiagnosisStatus.from_status(status()).key)
    assert decide(spec(), handled, NOW).action is Action.NOTHING
    assert decide(spec(), status(active=False), NOW).action is Action.NOTHING


def test_a_hang_may_keep_its_gpus_for_abort_hung_after_seconds():
    verdict = decide(spec({"abortHungAfterSeconds": 60}), status(), NOW)
    assert verdict.action is Action.WAIT and verdict.not_before == NOW + datetime.timedelta(seconds=50)
    assert decide(spec({"abortHungAfterSeconds": 5}), status(), NOW).action is Action.RESTART


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_an_ended_job_is_archived_once_when_an_archive_is_named(phase):
    assert decide(spec(archive=True), status(phase=phase), NOW).action is Action.ARCHIVE_FINAL
    assert decide(spec(archive=True), status(phase=phase), NOW, archived_final=True).action is Action.NOTHING
    assert decide(spec(), status(phase=phase), NOW).action is Action.NOTHING


def test_the_failed_message_names_every_attempts_culprits():
    attempts = [
        {"attempt": 0, "reason": "Hang", "ranks": [2], "nodes": ["gpu-1"]},
        {"attempt": 1, "reason": "StuckInCollective", "ranks": [4, 5], "nodes": ["gpu-3"]},
    ]
    assert culprits_text(attempts) == (
        "attempt 0: Hang, rank(s) 2 on gpu-1; attempt 1: StuckInCollective, rank(s) 4, 5 on gpu-3"
    )


def test_a_failed_worker_restarts_the_job_only_when_worker_failure_counts():
    from rankwatch.operator.lifecycle.job_status import WorkerPod, derive

    pods = [
        WorkerPod("j-worker-0", 0, "Running", True, "gpu-1", False, ""),
        WorkerPod("j-worker-1", 1, "Failed", False, "gpu-2", False, "container trainer exited with code 1 (Error)"),
    ]
    previous = {"phase": "Running", "conditions": []}
    failed, _ = derive(spec(), pods, previous, "2026-05-01T12:00:00Z", 1)
    assert failed["phase"] == "Failed" and "workerFailure" not in failed
    counting = spec({"restartOn": {"workerFailure": True}, "maxRestarts": 1})
    going_on, _ = derive(counting, pods, previous, "2026-05-01T12:00:00Z", 1)
    assert going_on["phase"] == "Running"
    failure = going_on["workerFailure"]
    assert (failure["attempt"], failure["pods"], failure["nodes"]) == (0, ["j-worker-1"], ["gpu-2"])
    verdict = decide(counting, going_on, NOW)
    assert (verdict.action, verdict.reason) == (Action.RESTART, "WorkerFailed")
    at_limit, _ = derive(counting, pods, {**previous, "restarts": 1}, "2026-05-01T12:00:00Z", 1)
    assert at_limit["phase"] == "Failed", "no restart left: the job fails, naming the worker"


def test_the_status_follows_the_current_attempts_pods_and_ends_restarting_when_they_run():
    from rankwatch.operator.lifecycle.job_status import WorkerPod, derive

    previous = {
        "phase": "Pending",
        "restarts": 1,
        "conditions": [
            {"type": "Restarting", "status": "True", "reason": "Hang", "message": "", "lastTransitionTime": "x"}
        ],
    }
    ending = [WorkerPod(f"j-worker-{i}", i, "Running", True, "gpu-1", True, "", attempt=0) for i in range(2)]
    fresh = [WorkerPod(f"j-r1-worker-{i}", i, "Running", True, "gpu-3", False, "", attempt=1) for i in range(2)]
    waiting, _ = derive(spec(), ending, previous, "2026-05-01T12:00:00Z", 1)
    assert waiting["phase"] == "Pending", "the ended attempt's pods are not this attempt's workers"
    running, events = derive(spec(), ending + fresh, previous, "2026-05-01T12:00:05Z", 1)
    assert running["phase"] == "Running" and [e.reason for e in events] == ["AllWorkersRunning"]
    restarting = next(c for c in running["conditions"] if c["type"] == "Restarting")
    assert restarting["status"] == "False" and restarting["message"].startswith("attempt 1: ")


def test_a_stragglers_slowdown_is_measured_for_restart_on_slowdown_above():
    from rankwatch.analysis.analyze import analyze
    from rankwatch.standins.scenario import Scenario, generate

    finding = analyze(generate(Scenario(16, tp=4, stragglers=((5, 0.3),))).trace)["findings"][0]
    assert finding["ranks"] == [5] and finding["evidence"]["slowdown"] == pytest.approx(0.3, abs=0.05)
