"""Job phase and conditions follow the worker pods."""

from __future__ import annotations

from rankwatch.operator.lifecycle import job_status
from rankwatch.operator.lifecycle.job_status import WorkerPod, derive, initial_conditions
from rankwatch.operator.spec import Tracing, TrainingJobSpec

SPEC = TrainingJobSpec(template={"spec": {"containers": []}}, replicas=3, nprocPerNode=8)
T0, T1, T2 = "2026-01-01T00:00:00Z", "2026-01-01T00:00:10Z", "2026-01-01T00:00:20Z"


def pod(index: int, phase: str = "Running", ready: bool = True, problem: str = "", deleting: bool = False) -> WorkerPod:
    return WorkerPod(f"job-worker-{index}", index, phase, ready, f"gpu-node-{index}", deleting, problem)


def fresh() -> dict:
    return {"phase": "Pending", "conditions": initial_conditions(SPEC, T0, 1)}


def condition(status: dict, type_: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_all_running_makes_the_job_running_with_an_event():
    status, events = derive(SPEC, [pod(0), pod(1), pod(2)], fresh(), T1, 1)
    assert status["phase"] == "Running"
    assert status["workers"] == "3/3"
    assert status["startTime"] == T1
    assert condition(status, "Running")["status"] == "True"
    assert [e.reason for e in events] == ["AllWorkersRunning"]
    assert "world size 24" in events[0].message


def test_partially_scheduled_stays_pending_and_names_the_blocked_worker():
    pods = [pod(0), pod(1, "Pending", False, "Unschedulable: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu.")]
    status, events = derive(SPEC, pods, fresh(), T1, 1)
    assert status["phase"] == "Pending"
    assert status["replicaStatuses"] == {"pending": 1, "running": 1, "succeeded": 0, "failed": 0, "missing": 1}
    assert "worker 1 (pod job-worker-1 on node gpu-node-1): Unschedulable" in status["message"]
    assert [e.type for e in events] == ["Warning"]
    _, events = derive(SPEC, pods, status, T2, 1)
    assert events == [], "the same scheduling problem is reported once"


def test_failed_worker_fails_the_job_with_its_exit_code():
    running, _ = derive(SPEC, [pod(0), pod(1), pod(2)], fresh(), T1, 1)
    pods = [pod(0), pod(1, "Failed", False, "container trainer exited with code 137 (OOMKilled)"), pod(2)]
    status, events = derive(SPEC, pods, running, T2, 1)
    assert status["phase"] == "Failed"
    assert status["completionTime"] == T2
    assert condition(status, "Failed")["status"] == "True"
    assert condition(status, "Running")["status"] == "False"
    assert events[0].type == "Warning" and "code 137 (OOMKilled)" in events[0].message
    assert "gpu-node-1" in events[0].message


def test_all_succeeded_completes_the_job_and_the_verdict_sticks():
    running, _ = derive(SPEC, [pod(0), pod(1), pod(2)], fresh(), T1, 1)
    done = [pod(i, "Succeeded", False) for i in range(3)]
    status, events = derive(SPEC, done, running, T2, 1)
    assert status["phase"] == "Succeeded" and events[0].reason == "AllWorkersSucceeded"
    later, events = derive(SPEC, [], status, "2026-01-01T01:00:00Z", 1)
    assert later == status and events == []


def test_worker_lost_while_running_fails_the_job():
    running, _ = derive(SPEC, [pod(0), pod(1), pod(2)], fresh(), T1, 1)
    status, events = derive(SPEC, [pod(0), pod(2)], running, T2, 1)
    assert status["phase"] == "Failed"
    assert events[0].reason == "WorkerLost" and "worker(s) 1 disappeared" in events[0].message


def test_deleting_pods_do_not_count():
    status, _ = derive(SPEC, [pod(0), pod(1), pod(2, deleting=True)], fresh(), T1, 1)
    assert status["phase"] == "Pending" and status["replicaStatuses"]["missing"] == 1


def test_transition_time_moves_only_when_status_changes():
    running, _ = derive(SPEC, [pod(0), pod(1), pod(2)], fresh(), T1, 1)
    same, events = derive(SPEC, [pod(0), pod(1), pod(2)], running, T2, 1)
    assert events == []
    assert condition(same, "Running")["lastTransitionTime"] == T1


def test_hang_and_degraded_are_unknown_until_analysed():
    conditions = {c["type"]: c for c in initial_conditions(SPEC, T0, 1)}
    assert conditions["Hung"]["status"] == "Unknown" and conditions["Hung"]["reason"] == "AwaitingTelemetry"
    off = TrainingJobSpec(template={}, tracing=Tracing(enabled=False))
    conditions = {c["type"]: c for c in initial_conditions(off, T0, 1)}
    assert conditions["Degraded"]["reason"] == "TracingDisabled"


def test_worker_pod_from_a_failed_pod_object():
    body = {
        "metadata": {"name": "job-worker-2", "labels": {"rankwatch.io/replica-index": "2"}},
        "spec": {"nodeName": "gpu-node-3"},
        "status": {
            "phase": "Failed",
            "containerStatuses": [{"name": "trainer", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}],
        },
    }
    worker = job_status.WorkerPod.from_pod(body)
    assert (worker.index, worker.node, worker.phase) == (2, "gpu-node-3", "Failed")
    assert worker.problem == "container trainer exited with code 1 (Error)"


def waiting_pod(index: int, phase: str, container: str, reason: str, message: str, init: bool = False) -> WorkerPod:
    statuses = [{"name": container, "state": {"waiting": {"reason": reason, "message": message}}}]
    return WorkerPod.from_pod(
        {
            "metadata": {"name": f"job-worker-{index}", "labels": {"rankwatch.io/replica-index": str(index)}},
            "spec": {"nodeName": f"gpu-node-{index}"},
            "status": {
                "phase": phase,
                "conditions": [{"type": "PodScheduled", "status": "True"}],
                ("initContainerStatuses" if init else "containerStatuses"): statuses,
            },
        }
    )


def test_a_container_that_cannot_start_gives_the_job_its_reason_once():
    pulling = waiting_pod(1, "Pending", "rankwatch-init", "ImagePullBackOff", "Back-off pulling image", init=True)
    status, events = derive(SPEC, [pod(0), pulling, pod(2)], fresh(), T1, 1)
    assert status["phase"] == "Pending" and status["reason"] == "ImagePullBackOff"
    assert status["message"] == (
        "waiting for 1 of 3 workers to start; worker 1 (pod job-worker-1 on node gpu-node-1): "
        "container rankwatch-init ImagePullBackOff: Back-off pulling image"
    )
    assert condition(status, "Running")["reason"] == "ImagePullBackOff"
    assert [(e.type, e.reason) for e in events] == [("Warning", "ImagePullBackOff")]
    _, events = derive(SPEC, [pod(0), pulling, pod(2)], status, T2, 1)
    assert events == [], "reported once per reason"
    retrying = waiting_pod(1, "Pending", "rankwatch-init", "ErrImagePull", "pull access denied", init=True)
    again, events = derive(SPEC, [pod(0), retrying, pod(2)], status, T2, 1)
    assert again["reason"] == "ErrImagePull" and events == [], "the kubelet's retry is the same problem"


def test_starting_containers_are_no_problem():
    creating = waiting_pod(1, "Pending", "trainer", "ContainerCreating", "")
    status, events = derive(SPEC, [pod(0), creating, pod(2)], fresh(), T1, 1)
    assert status["reason"] == "WorkersPending" and events == []


def test_a_crash_looping_running_worker_shows_on_the_running_job():
    running, _ = derive(SPEC, [pod(0), pod(1), pod(2)], fresh(), T1, 1)
    looping = waiting_pod(2, "Running", "trainer", "CrashLoopBackOff", "back-off 40s restarting failed container")
    status, events = derive(SPEC, [pod(0), pod(1), looping], running, T2, 1)
    assert status["phase"] == "Running" and status["reason"] == "CrashLoopBackOff"
    assert "worker 2 (pod job-worker-2 on node gpu-node-2): container trainer CrashLoopBackOff" in status["message"]
    assert [(e.type, e.reason) for e in events] == [("Warning", "CrashLoopBackOff")]


SUSPENDED_SPEC = TrainingJobSpec(template={"spec": {"containers": []}}, replicas=3, nprocPerNode=8, suspend=True)


def test_a_job_created_suspended_says_so_and_wants_no_workers():
    status = {"phase": "Suspended", "conditions": initial_conditions(SUSPENDED_SPEC, T0, 1)}
    assert condition(status, "Suspended")["status"] == "True"
    assert "no worker pods" in condition(status, "Created")["message"]
    status, events = derive(SUSPENDED_SPEC, [], status, T1, 1)
    assert status["phase"] == "Suspended" and status["workers"] == "0/3"
    assert events == [], "already suspended: nothing new to tell"


def test_suspending_a_running_job_counts_its_pods_down_and_never_fails_it():
    running, _ = derive(SPEC, [pod(0), pod(1), pod(2)], fresh(), T1, 1)
    ending = [pod(0, deleting=True), pod(1, deleting=True), pod(2)]
    status, events = derive(SUSPENDED_SPEC, ending, running, T2, 2)
    assert status["phase"] == "Suspended" and "3 worker pod(s) being deleted" in status["message"]
    assert condition(status, "Suspended")["status"] == "True"
    assert condition(status, "Running")["status"] == "False"
    assert [e.reason for e in events] == ["Suspended"]
    gone, events = derive(SUSPENDED_SPEC, [], status, T2, 2)
    assert gone["phase"] == "Suspended" and "no worker pods" in gone["message"], "workers gone is no WorkerLost"
    assert events == []


def test_resuming_waits_for_the_new_workers_then_runs():
    suspended, _ = derive(SUSPENDED_SPEC, [], {"phase": "Suspended", "conditions": []}, T1, 2)
    status, events = derive(SPEC, [], suspended, T2, 3)
    assert status["phase"] == "Pending" and status["replicaStatuses"]["missing"] == 3
    assert condition(status, "Suspended")["status"] == "False"
    assert [e.reason for e in events] == ["Resumed"]
    status, events = derive(SPEC, [pod(0), pod(1), pod(2)], status, T2, 3)
    assert status["phase"] == "Running" and [e.reason for e in events] == ["AllWorkersRunning"]


def test_workers_gated_by_a_queue_await_admission_without_a_warning():
    gated = {
        "metadata": {"name": "job-worker-0", "labels": {"rankwatch.io/replica-index": "0"}},
        "spec": {"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]},
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}],
        },
    }
    worker = WorkerPod.from_pod(gated)
    assert worker.problem_reason == job_status.GATED and not worker.container_problem
    assert "kueue.x-k8s.io/admission" in worker.problem
    status, events = derive(SPEC, [worker], fresh(), T1, 1)
    assert status["phase"] == "Pending" and status["reason"] == "AwaitingAdmission"
    assert "waiting for admission (scheduling gates: kueue.x-k8s.io/admission)" in status["message"]
    assert events == []
