"""The decisions behind a group's restart: the shared safeguards, and each lever's own refusals read from
the owning object as its controller would."""

from __future__ import annotations

from typing import Any

import pytest

from rankwatch.model.diagnosis_status import DiagnosisStatus
from rankwatch.operator.kinds.group_settings import group_settings
from rankwatch.operator.kinds.registry import ADAPTERS
from rankwatch.operator.kinds.restart import Action, lever_of, verdict
from rankwatch.operator.kinds.restart_indexed_job import INDEXED_JOB_LEVER
from rankwatch.operator.kinds.restart_jobset import JOBSET_LEVER, failure_answer, restarts_counted
from rankwatch.operator.kinds.restart_trainjob import TRAINJOB_LEVER, suspend_owner
from rankwatch.operator.kinds.restart_volcano import VOLCANO_LEVER, restart_command
from rankwatch.operator.spec import InvalidSpec, Recovery, Remediation, TrainingJobSpec

SPEC = TrainingJobSpec(template={})
HANG_RECORD = {"active": True, "time": "2026-11-28T18:00:00Z", "kind": "Hang", "cause": "host", "ranks": [2],
        "nodes": ["gpu-node-1"], "pods": ["job-0-abc"], "remediation": "cordoned and tainted gpu-node-1"}  # fmt: skip
HANG = DiagnosisStatus.from_record(HANG_RECORD)
CORDONED = {"gpu-node-1": True}


def changed(**fields: Any) -> DiagnosisStatus | None:
    return DiagnosisStatus.from_record({**HANG_RECORD, **fields})


def test_a_cordoned_hang_restarts():
    assert verdict(HANG, SPEC, CORDONED).action is Action.RESTART


@pytest.mark.parametrize(
    "change",
    [
        {"restart": "suspended the Job"},  # once per diagnosis
        {"active": False},
        {"kind": "Mismatch", "cause": "software"},  # the job's own code: a restart meets it again
        {"kind": "Straggler"},  # as a TrainingJob: a slowdown only cordons unless asked to restart
    ],
)
def test_nothing_is_done_for(change):
    assert verdict(changed(**change), SPEC, CORDONED).action is Action.NOTHING


def test_a_restart_waits_for_the_cordon_to_be_recorded():
    assert verdict(changed(remediation=None), SPEC, CORDONED).action is Action.WAIT


def test_a_restart_is_skipped_and_said_when_unsafe():
    assert "names no node" in verdict(changed(nodes=[]), SPEC, {}).message
    not_cordoned = verdict(HANG, SPEC, {"gpu-node-1": False})
    assert not_cordoned.action is Action.SKIP and "gpu-node-1 not cordoned" in not_cordoned.message
    dry = TrainingJobSpec(template={}, remediation=Remediation(dryRun=True))
    assert verdict(HANG, dry, CORDONED).message.startswith("dry run")
    off = TrainingJobSpec(template={}, recovery=Recovery(policy="None"))
    assert verdict(HANG, off, CORDONED).action is Action.SKIP


def test_pod_annotations_set_the_recovery_policy_and_limit_and_bad_ones_are_refused():
    pod = {"metadata": {"annotations": {"rankwatch.io/recovery": "None", "rankwatch.io/max-restarts": "1"}}}
    settings = group_settings(pod, "Job ns/a")
    assert settings.spec(2).recovery == Recovery(policy="None", maxRestarts=1)
    with pytest.raises(InvalidSpec, match=r"rankwatch\.io/recovery='Always'"):
        group_settings({"metadata": {"annotations": {"rankwatch.io/recovery": "Always"}}}, "Job ns/a")


def job(**changes: Any) -> dict[str, Any]:
    base = {"metadata": {"name": "a", "labels": {}, "annotations": {}}, "spec": {"completions": 2}}
    for key, value in changes.items():
        base[key] = {**base.get(key, {}), **value}
    return base


def test_the_suspend_toggle_is_refused_where_someone_else_owns_suspend():
    assert INDEXED_JOB_LEVER.refusal(None, job(), HANG, [], SPEC) is None
    kueue = job(metadata={"labels": {"kueue.x-k8s.io/queue-name": "team"}})
    assert "Kueue" in INDEXED_JOB_LEVER.refusal(None, kueue, HANG, [], SPEC)
    owned = job(metadata={"ownerReferences": [{"kind": "CronJob", "name": "nightly", "controller": True}]})
    assert "CronJob nightly" in INDEXED_JOB_LEVER.refusal(None, owned, HANG, [], SPEC)
    assert "suspended already" in INDEXED_JOB_LEVER.refusal(None, job(spec={"suspend": True}), HANG, [], SPEC)
    used = job(metadata={"annotations": {"rankwatch.io/restarts": "3"}})
    assert "3 restart(s) of at most 3" in INDEXED_JOB_LEVER.refusal(None, used, HANG, [], SPEC)


def test_a_trainjobs_suspend_is_left_to_kueue_or_another_manager_that_owns_it():
    mine = job(spec={"managedBy": "trainer.kubeflow.org/trainjob-controller"})
    assert suspend_owner(job()) is None and suspend_owner(mine) is None
    assert TRAINJOB_LEVER.refusal(None, job(), HANG, [], SPEC) is None
    kueue = job(metadata={"labels": {"kueue.x-k8s.io/queue-name": "team"}})
    assert "Kueue admits this TrainJob" in suspend_owner(kueue)
    assert "managed by kueue.x-k8s.io/multikueue" in suspend_owner(job(spec={"managedBy": "kueue.x-k8s.io/multikueue"}))
    owned = job(metadata={"ownerReferences": [{"kind": "Pipeline", "name": "p", "controller": True}]})
    assert "Pipeline p" in suspend_owner(owned)


def test_a_trainjobs_suspend_toggle_is_refused_when_suspended_or_past_its_limit():
    assert "suspended already" in TRAINJOB_LEVER.refusal(None, job(spec={"suspend": True}), HANG, [], SPEC)
    used = job(metadata={"annotations": {"rankwatch.io/restarts": "1"}})
    one = TrainingJobSpec(template={}, recovery=Recovery(maxRestarts=1))
    assert "1 restart(s) of at most 1" in TRAINJOB_LEVER.refusal(None, used, HANG, [], one)
    assert TRAINJOB_LEVER.refusal(None, used, HANG, [], SPEC) is None


def test_a_jobsets_answer_to_a_failed_child_job_is_read_as_its_controller_reads_it():
    assert failure_answer({}, "workers") == ("RestartJobSet", "")
    rules = {"rules": [
        {"name": "other-job", "action": "FailJobSet", "targetReplicatedJobs": ["driver"]},
        {"name": "evicted", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]},
        {"name": "deadline", "action": "RestartJob", "onJobFailureMessagePatterns": ["longer than", "("]},
    ]}  # fmt: skip
    assert failure_answer(rules, "workers") == ("RestartJob", "deadline")
    assert failure_answer(rules, "driver") == ("FailJobSet", "other-job")
    counted = {"restartsCountTowardsMax": 1, "replicatedJobsStatus": [{"jobRestartsCountTowardsMax": [1, 0]}]}
    assert restarts_counted(counted) == 2


def jobset(policy: dict[str, Any] | None, status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"spec": {"failurePolicy": policy} if policy is not None else {}, "status": status or {}}


POD = {"metadata": {"name": "job-0-abc", "labels": {"jobset.sigs.k8s.io/restart-attempt": "0",
       "jobset.sigs.k8s.io/replicatedjob-name": "workers"},
       "ownerReferences": [{"kind": "Job", "name": "s-workers-0", "controller": True}]}}  # fmt: skip


def test_the_jobset_lever_is_refused_unless_the_jobset_restarts_the_whole_group_within_its_limit():
    assert JOBSET_LEVER.refusal(None, jobset({"maxRestarts": 2}), HANG, [POD], SPEC) is None
    assert "no spec.failurePolicy" in JOBSET_LEVER.refusal(None, jobset(None), HANG, [POD], SPEC)
    individual = [{"jobRestartsCountTowardsMax": [1]}]
    used = jobset({"maxRestarts": 2}, {"restartsCountTowardsMax": 1, "replicatedJobsStatus": individual})
    assert "2 restart(s) of at most 2" in JOBSET_LEVER.refusal(None, used, HANG, [POD], SPEC)
    one_job = jobset({"maxRestarts": 2, "rules": [{"name": "r", "action": "RestartJob"}]})
    assert "with RestartJob" in JOBSET_LEVER.refusal(None, one_job, HANG, [POD], SPEC)
    assert "none of the pods" in JOBSET_LEVER.refusal(None, jobset({"maxRestarts": 2}), HANG, [], SPEC)


def test_the_volcano_command_is_vcctls_and_is_refused_past_max_retry():
    owner = {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "spec": {}, "status": {"retryCount": 3},
             "metadata": {"name": "v", "namespace": "ns", "uid": "u-1"}}  # fmt: skip
    command = restart_command(owner, HANG)
    target = {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "name": "v", "uid": "u-1",
              "controller": True, "blockOwnerDeletion": True}  # fmt: skip
    assert command["action"] == "RestartJob" and command["target"] == target
    assert command["metadata"]["ownerReferences"] == [target] and command["metadata"]["name"].startswith(
        "v-restartjob-"
    )
    assert restart_command(owner, HANG)["metadata"]["name"] == command["metadata"]["name"], "one per diagnosis"
    assert "3 retries of at most 3" in VOLCANO_LEVER.refusal(None, owner, HANG, [], SPEC)
    assert VOLCANO_LEVER.refusal(None, {**owner, "status": {}}, HANG, [], SPEC) is None


def test_an_adapter_names_a_restart_lever_exactly_when_rankwatch_pulls_one():
    for adapter in ADAPTERS:
        assert (adapter.restart_lever is None) == (lever_of(adapter.key) is None), adapter.key


def test_a_pytorchjobs_suspend_toggle_is_refused_where_kueue_owns_it_the_job_ended_or_restarts_are_used():
    from rankwatch.operator.kinds.restart_pytorchjob import PYTORCHJOB_LEVER

    def pytorchjob(**parts: Any) -> dict[str, Any]:
        return {"metadata": {"name": "llama", **parts.get("metadata", {})}, "spec": parts.get("spec", {}),
                "status": parts.get("status", {})}  # fmt: skip

    assert lever_of("PyTorchJob") is PYTORCHJOB_LEVER
    running = pytorchjob(status={"conditions": [{"type": "Running", "status": "True"}]})
    assert PYTORCHJOB_LEVER.refusal(None, running, HANG, [], SPEC) is None
    kueue = pytorchjob(metadata={"labels": {"kueue.x-k8s.io/queue-name": "team"}})
    assert "its spec.runPolicy.suspend is Kueue's" in PYTORCHJOB_LEVER.refusal(None, kueue, HANG, [], SPEC)
    owned = pytorchjob(metadata={"ownerReferences": [{"kind": "Pipeline", "name": "nightly", "controller": True}]})
    assert "Pipeline nightly" in PYTORCHJOB_LEVER.refusal(None, owned, HANG, [], SPEC)
    suspended = pytorchjob(spec={"runPolicy": {"suspend": True}})
    assert "suspended already" in PYTORCHJOB_LEVER.refusal(None, suspended, HANG, [], SPEC)
    failed = pytorchjob(status={"conditions": [{"type": "Running", "status": "False"},
                                               {"type": "Failed", "status": "True"}]})  # fmt: skip
    assert "has Failed" in PYTORCHJOB_LEVER.refusal(None, failed, HANG, [], SPEC)
    used = pytorchjob(metadata={"annotations": {"rankwatch.io/restarts": "3"}})
    assert "3 restart(s) of at most 3" in PYTORCHJOB_LEVER.refusal(None, used, HANG, [], SPEC)
