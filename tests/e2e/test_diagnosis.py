"""In-cluster diagnosis end to end: real operator (collector, detector, diagnosis), real sidecars and
interposer, worker pods run as local processes by the pod runner on the stand-in NCCL, faults
injected through the job template's env on one rank."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Any

import kubernetes
import pytest
from trainingjobs import (
    ARMED_RUNS,
    JOB_API,
    SENSITIVITY,
    STANDIN_DEVICE,
    STRAGGLER,
    WINDOW,
    condition,
    create_job,
    detector_runs,
    diagnosed,
    events,
    get_job,
    judge,
    node_marks,
    node_of_pod,
    operator_metric,
    report,
    standin_job,
    stored_diagnosis,
    turned_down,
    wait_running,
)

pytestmark = pytest.mark.e2e

HEALTHY_RUNS = ARMED_RUNS + 5
"""Detector runs a healthy job with jitter is judged over with no finding once its telemetry flows: every
check armed, and a few more; a whole retry period more after each diagnosis that found nothing (a suspicion
the analysis turned down is looked at again: ``judge``)."""
UNLOCALISABLE_RUNS = ARMED_RUNS
"""Detector runs a job whose fault host call times cannot localise is judged over without a wrong rank
named once its telemetry flows: every check armed (and a retry period more after a suspicion turned down)."""
DIAGNOSIS_KINDS = ("Hang", "StuckInCollective", "Straggler", "SlowLink", "FailSlow", "CollectiveMismatch")


@pytest.fixture
def uncordon_afterwards(api, namespace):
    """Whatever the test's jobs got cordoned is undone, so the next tests have all four nodes (the
    session operator runs without the cooldown after an undo: the two variants may land on one node)."""
    from rankwatch.operator.remediation.cordon import uncordon_job

    yield
    jobs = kubernetes.client.CustomObjectsApi(api).list_namespaced_custom_object(*JOB_API[:2], namespace, JOB_API[2])
    for job in jobs["items"]:
        uncordon_job(api, namespace, job["metadata"]["name"], via="test")


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "cordon"])
def test_straggler_on_one_node_is_diagnosed_with_rank_node_and_event(
    api, kubectl, kubeconfig, namespace, pod_runner, eventually, uncordon_afterwards, dry_run
):
    name = "slow-dry" if dry_run else "slow"
    faults = STRAGGLER
    create_job(api, namespace, standin_job(name, faults, remediation={"cordon": True, "dryRun": dry_run}))
    started = wait_running(api, namespace, name, eventually)
    job = eventually(lambda: diagnosed(api, namespace, name, "Degraded"), 90, interval=1, what="Degraded=True")
    latency = time.monotonic() - started
    node = node_of_pod(api, namespace, f"{name}-worker-1")
    diagnosis = stored_diagnosis(job)
    assert diagnosis["kind"] == "Straggler" and diagnosis["active"] is True
    assert diagnosis["ranks"] == [5] and diagnosis["nodes"] == [node] and diagnosis["pods"] == [f"{name}-worker-1"]
    assert job["status"]["health"] == "Degraded" and job["status"]["suspects"] == node
    # the annotations follow the status write (a patch of their own): a busy machine shows the status first
    annotations = eventually(
        lambda: (
            (a := get_job(api, namespace, name)["metadata"].get("annotations") or {})
            and "rankwatch.io/suspect-nodes" in a
            and a
        ),
        20,
        what="the suspect annotations",
    )
    assert annotations["rankwatch.io/suspect-nodes"] == node
    assert annotations["rankwatch.io/suspect-ranks"] == "5"
    assert condition(job, "Degraded")["reason"] == "Straggler"
    assert condition(job, "Hung")["status"] == "False"
    assert "rank 5 (tp 1, dp 1, pp 0)" in diagnosis["summary"] and node in diagnosis["summary"]
    assert report(api, namespace, job)["findings"][0]["ranks"] == [5]

    described = eventually(
        lambda: (
            (out := kubectl("describe", "tj", name, "-n", namespace).stdout) and "Warning  Straggler" in out and out
        ),
        20,
        what="the Straggler Event in kubectl describe",
    )
    assert "rank 5 (tp 1, dp 1, pp 0)" in described
    # `rankwatch describe` says the same of a TrainingJob as of a job of any other kind
    ours = subprocess.run(
        # as a user runs it, with their own kubeconfig (not the operator's, which e2e-rbac's $KUBECONFIG is)
        [sys.executable, "-m", "rankwatch", "describe", f"tj/{name}", "-n", namespace, "--kubeconfig", kubeconfig],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "Health:       Degraded" in ours and "  Kind:        Straggler" in ours and "  Ranks:       5" in ours
    assert f"  Nodes:       {node}" in ours and "Warning  Straggler" in ours

    # remediation: that node (and only it) cordoned, tainted and annotated; in dry run only annotated
    marked = eventually(
        lambda: (m := node_marks(api, node)[2]).get("rankwatch.io/cordon-job") == f"{namespace}/{name}" and m,
        30,
        what="the suspect node's annotations",
    )
    assert marked.get("rankwatch.io/dry-run") == ("true" if dry_run else None), marked
    unschedulable, taints, _ = node_marks(api, node)
    recorded = eventually(
        lambda: stored_diagnosis(get_job(api, namespace, name)).get("remediation"), 30, what="remediation recorded"
    )
    assert recorded == (f"dry run: would cordon and taint {node}" if dry_run else f"cordoned and tainted {node}")
    warnings = [e for e in events(api, namespace, name) if e.reason == "Straggler"]
    assert len(warnings) == 1 and warnings[0].type == "Warning", warnings
    if dry_run:
        assert not unschedulable and not [t for t in taints if t.startswith("rankwatch.io/suspect")]
    else:
        assert unschedulable and [t for t in taints if t.startswith("rankwatch.io/suspect=")], taints
    others = [n.metadata.name for n in kubernetes.client.CoreV1Api(api).list_node().items if n.metadata.name != node]
    touched = [n for n in others if node_marks(api, n)[0] or node_marks(api, n)[2].get("rankwatch.io/cordon-job")]
    assert not touched, f"only the suspect node is touched, not {touched}"
    print(f"straggler (30% slower) diagnosed {latency:.1f} s after the job started running: {diagnosis['summary']}")


def test_rank_that_never_calls_makes_the_job_hung_naming_it(api, kubectl, namespace, pod_runner, eventually):
    faults = {"RANKWATCH_STANDIN_FAULT_RANK": "2", "RANKWATCH_STANDIN_HANG_BEFORE_CALL": "300"}
    create_job(api, namespace, standin_job("hang", faults))
    wait_running(api, namespace, "hang", eventually)
    job = eventually(lambda: diagnosed(api, namespace, "hang", "Hung"), 90, interval=1, what="Hung=True")
    diagnosis = stored_diagnosis(job)
    node = node_of_pod(api, namespace, "hang-worker-0")
    assert diagnosis["kind"] == "Hang" and diagnosis["ranks"] == [2] and diagnosis["nodes"] == [node]
    assert condition(job, "Hung")["reason"] == "Hang" and job["status"]["health"] == "Hung"
    finding = report(api, namespace, job)["findings"][0]
    waited = finding["evidence"]["waiting_seconds"]  # since the culprit's peers entered the call it never made
    assert waited <= SENSITIVITY + 15, f"hang diagnosed {waited} s after it began (target sensitivity + 15 s)"
    described = eventually(
        lambda: (out := kubectl("describe", "tj", "hang", "-n", namespace).stdout) and "Warning  Hang" in out and out,
        20,
        what="the Hang Event in kubectl describe",
    )
    assert "rank 2" in described
    [gpu] = finding["evidence"]["gpus"]  # the ring header names the GPU the rank ran on
    assert (gpu["rank"], gpu["node"]) == (2, node) and gpu["uuid"].startswith("GPU-")
    event = next(e for e in events(api, namespace, "hang") if e.reason == "Hang")
    assert f"kubectl get configmap -n {namespace} hang-rankwatch-report" in event.message
    print(f"hang diagnosed {waited:.1f} s after onset (sensitivity {SENSITIVITY} s): {diagnosis['summary']}")


def test_without_gpu_timing_the_rank_that_never_called_is_still_named(api, namespace, pod_runner, eventually):
    """Host call times only: on the asynchronous device every call returns at once, the peers' hosts block
    in a synchronisation, not in NCCL; who stopped calling is what still names the culprit."""
    faults = {"RANKWATCH_STANDIN_FAULT_RANK": "2", "RANKWATCH_STANDIN_HANG_BEFORE_CALL": "300"}
    create_job(api, namespace, standin_job("hang-untimed", faults, gpu_timing=False))
    wait_running(api, namespace, "hang-untimed", eventually)
    job = eventually(lambda: diagnosed(api, namespace, "hang-untimed", "Hung"), 90, interval=1, what="Hung=True")
    diagnosis = stored_diagnosis(job)
    assert diagnosis["kind"] == "Hang" and diagnosis["ranks"] == [2], diagnosis
    assert diagnosis["nodes"] == [node_of_pod(api, namespace, "hang-untimed-worker-0")]


def test_without_gpu_timing_a_straggler_is_not_pinned_on_a_wrong_rank(
    api, namespace, pod_runner, eventually, collector_url
):
    """Host call times of a run-ahead job cannot tell the slow GPU: the expected answer is "not
    localisable" (no finding naming anyone else), never a wrong node."""
    faults = {"RANKWATCH_STANDIN_FAULT_RANK": "5", "RANKWATCH_STANDIN_SLOWDOWN": "0.3"}
    seen = turned_down(f"{collector_url}/metrics")
    create_job(api, namespace, standin_job("slow-untimed", faults, gpu_timing=False))
    wait_running(api, namespace, "slow-untimed", eventually)
    eventually(
        lambda: condition(get_job(api, namespace, "slow-untimed"), "Degraded").get("reason") == "TelemetryHealthy",
        60,
        what="telemetry flowing",
    )

    def nobody_else_named() -> None:
        diagnosis = stored_diagnosis(get_job(api, namespace, "slow-untimed"))
        assert set(diagnosis.get("ranks") or []) <= {5}, diagnosis

    metrics = f"{collector_url}/metrics"
    judge(metrics, namespace, ("slow-untimed",), nobody_else_named, eventually, UNLOCALISABLE_RUNS, seen)


def test_rank_stuck_inside_a_collective_is_told_from_ranks_waiting(api, namespace, pod_runner, eventually):
    faults = {"RANKWATCH_STANDIN_FAULT_RANK": "6", "RANKWATCH_STANDIN_STUCK_IN_CALL": "300"}
    create_job(api, namespace, standin_job("stuck", faults))
    wait_running(api, namespace, "stuck", eventually)
    job = eventually(lambda: diagnosed(api, namespace, "stuck", "Hung"), 90, interval=1, what="Hung=True")
    diagnosis = stored_diagnosis(job)
    assert diagnosis["kind"] == "StuckInCollective", diagnosis
    if STANDIN_DEVICE == "async":
        # Rank 6's call 300 was enqueued (its host returned) but its GPU never started it, while its TP
        # peers' GPUs started theirs and wait inside: the GPU times name rank 6 alone, not its TP group
        # nor the ranks merely waiting for it (the other pod's, in the DP AllReduce).
        assert diagnosis["ranks"] == [6], diagnosis
    else:  # synchronous: the call never returns, its GPU start looks like its peers'; the TP group is named
        assert 6 in diagnosis["ranks"] and set(diagnosis["ranks"]) <= {4, 5, 6, 7}, diagnosis
    assert diagnosis["nodes"] == [node_of_pod(api, namespace, "stuck-worker-1")]
    assert condition(job, "Hung")["reason"] == "StuckInCollective"


def test_without_gpu_timing_a_stuck_rank_is_a_hang_that_names_nobody_else(api, namespace, pod_runner, eventually):
    """Host call times only: rank 6's call returned like every other, its GPU never started it, and every
    host then waits at its next synchronisation. The job is reported hung; host times cannot tell rank 6
    from the ranks waiting for it, so the expected answer is "not localisable" (nobody named, no node),
    or rank 6 alone - never a waiting rank's node."""
    faults = {"RANKWATCH_STANDIN_FAULT_RANK": "6", "RANKWATCH_STANDIN_STUCK_IN_CALL": "300"}
    create_job(api, namespace, standin_job("stuck-untimed", faults, gpu_timing=False))
    wait_running(api, namespace, "stuck-untimed", eventually)
    job = eventually(lambda: diagnosed(api, namespace, "stuck-untimed", "Hung"), 90, interval=1, what="Hung=True")
    diagnosis = stored_diagnosis(job)
    assert diagnosis["kind"] in ("Hang", "StuckInCollective"), diagnosis
    assert diagnosis["ranks"] in ([], [6]), diagnosis
    assert diagnosis["nodes"] in ([], [node_of_pod(api, namespace, "stuck-untimed-worker-1")]), diagnosis
    print(f"stuck rank, host times only: {diagnosis['kind']} naming {diagnosis['ranks']}: {diagnosis['summary']}")


LINK_FAULT = {
    # rank 1 (stage 0, pod 0) and rank 5 (tp 1 of stage 1, pod 1) are pipeline neighbours: every transfer
    # between them is 3 ms late on rank 1's GPU (its sends leave late, its receives land late)
    "RANKWATCH_STANDIN_FAULT_RANK": "1",
    "RANKWATCH_STANDIN_LINK_PEER": "5",
    "RANKWATCH_STANDIN_LINK_LATENCY_US": "3000",
}


def slow_link_job(name: str, gpu_timing: bool) -> dict[str, Any]:
    """TP 4 x PP 2, one stage per pod and one pod per node (so the link between the stages crosses nodes),
    rank 1's link to rank 5 slow; nodes cordoned for real (the healthy ones must stay schedulable)."""
    manifest = standin_job(name, LINK_FAULT, gpu_timing=gpu_timing, remediation={"cordon": True}, pipeline=2)
    one_per_node = {"labelSelector": {"matchLabels": {"rankwatch.io/job-name": name}},
                    "topologyKey": "kubernetes.io/hostname"}  # fmt: skip
    manifest["spec"]["template"]["spec"]["affinity"] = {
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [one_per_node]}
    }
    return manifest


def marked_nodes(api) -> list[str]:
    """Nodes that are unschedulable or carry a rankwatch cordon mark."""
    return sorted(
        n.metadata.name
        for n in kubernetes.client.CoreV1Api(api).list_node().items
        if node_marks(api, n.metadata.name)[0] or node_marks(api, n.metadata.name)[2].get("rankwatch.io/cordon-job")
    )


def test_slow_pipeline_link_between_nodes_is_named_with_both_ends(
    api, kubectl, namespace, pod_runner, eventually, uncordon_afterwards
):
    create_job(api, namespace, slow_link_job("link", gpu_timing=True))
    started = wait_running(api, namespace, "link", eventually)
    job = eventually(lambda: diagnosed(api, namespace, "link", "Degraded"), 90, interval=1, what="Degraded=True")
    latency = time.monotonic() - started
    ends = sorted({node_of_pod(api, namespace, "link-worker-0"), node_of_pod(api, namespace, "link-worker-1")})
    assert len(ends) == 2, f"the two stages' pods on one node: {ends}"
    diagnosis = stored_diagnosis(job)
    # the GPU start/end of matched sends and receives time the transfers once both sides are ready: the
    # pair 1<->5 is slow, not rank 1 or rank 5 as a straggler (each waits on the other through the link)
    assert diagnosis["kind"] == "SlowLink" and condition(job, "Degraded")["reason"] == "SlowLink", diagnosis
    assert diagnosis["ranks"] == [1, 5] and diagnosis["nodes"] == ends, diagnosis
    assert "rank 1" in diagnosis["summary"] and "rank 5" in diagnosis["summary"], diagnosis["summary"]
    finding = report(api, namespace, job)["findings"][0]
    assert finding["kind"] == "slow_link" and finding["evidence"]["median_transfer_ms"] >= 2.5, finding
    # a link has two ends and either may hold the fault: both nodes are taken out, no other node
    eventually(lambda: marked_nodes(api) == ends, 30, what=f"exactly {ends} cordoned")
    done = eventually(
        lambda: stored_diagnosis(get_job(api, namespace, "link")).get("remediation"), 30, what="remediation"
    )
    print(f"slow link (3 ms per transfer) diagnosed {latency:.1f} s after the job started running: "
          f"{diagnosis['summary']}; {done}", file=sys.__stdout__)  # fmt: skip


def test_without_gpu_timing_a_slow_link_names_nobody(
    api, namespace, pod_runner, eventually, uncordon_afterwards, collector_url
):
    """Host call times of a run-ahead job: every send and receive returns at once, so the slow transfers
    are in nobody's call times; only the step time is longer. The expected answer is "not localisable"
    (the analysis says so when asked: "a slowdown is not localisable from call times; enable GPU timing"):
    the job stays Healthy with its step time, no finding, no node cordoned, never a wrong rank."""
    seen = turned_down(f"{collector_url}/metrics")
    create_job(api, namespace, slow_link_job("link-untimed", gpu_timing=False))
    wait_running(api, namespace, "link-untimed", eventually)
    job = eventually(
        lambda: (
            (j := get_job(api, namespace, "link-untimed"))
            and condition(j, "Degraded").get("reason") == "TelemetryHealthy"
            and j
        ),
        60,
        what="telemetry flowing",
    )
    assert job["status"].get("stepTime"), job["status"]

    def nobody_named() -> None:
        diagnosis = stored_diagnosis(get_job(api, namespace, "link-untimed"))
        assert not diagnosis.get("nodes"), f"a slow link named from host times: {diagnosis}"
        assert not marked_nodes(api), "a node cordoned on host call times"

    metrics = f"{collector_url}/metrics"
    judge(metrics, namespace, ("link-untimed",), nobody_named, eventually, UNLOCALISABLE_RUNS, seen)
    job = get_job(api, namespace, "link-untimed")
    assert job["status"]["health"] == "Healthy", job["status"]
    print(f"slow link without GPU timing: Healthy, step time {job['status']['stepTime']}, nobody named",
          file=sys.__stdout__)  # fmt: skip


def test_healthy_job_with_jitter_gets_no_finding(api, namespace, pod_runner, eventually, collector_url):
    """Two healthy jobs side by side, one GPU-timed (the default) and one with host call times only, each
    judged HEALTHY_RUNS times by the detector (and a retry period more after a suspicion turned down): neither
    gets a finding, a Degraded or Hung condition, or a diagnosis Event."""
    names = ("calm", "calm-untimed")
    metrics = f"{collector_url}/metrics"
    seen = turned_down(metrics)
    create_job(api, namespace, standin_job("calm"))
    create_job(api, namespace, standin_job("calm-untimed", gpu_timing=False))
    for name in names:
        wait_running(api, namespace, name, eventually)
    for name in names:
        job = eventually(
            lambda name=name: (
                (j := get_job(api, namespace, name))
                and condition(j, "Degraded").get("reason") == "TelemetryHealthy"
                and j
            ),
            60,
            what=f"telemetry flowing from {name}",
        )
        assert job["status"]["health"] == "Healthy" and job["status"].get("stepTime")

    def nothing_found() -> None:
        for name in names:
            job = get_job(api, namespace, name)
            assert condition(job, "Degraded")["status"] == "False", job
            assert condition(job, "Hung")["status"] == "False", job
            assert "diagnosis" not in job["status"], job

    judge(metrics, namespace, names, nothing_found, eventually, HEALTHY_RUNS, seen)
    for name in names:
        assert not [e for e in events(api, namespace, name) if e.reason in DIAGNOSIS_KINDS], name


def test_operator_on_uvloop_diagnoses_a_straggler(
    api, kubeconfig, unwatched_namespace, processes, eventually, tmp_path
):
    """RANKWATCH_EVENT_LOOP=uvloop: kopf, the collector, the monitor and the diagnosis all on libuv's loop."""
    namespace = unwatched_namespace
    port = processes.free_port()
    log = tmp_path / "operator.log"
    operator = processes.operator(kubeconfig, namespace, log, port, {"RANKWATCH_EVENT_LOOP": "uvloop"})
    runner = processes.pod_runner(kubeconfig, f"http://127.0.0.1:{port}", namespace, tmp_path / "pods")
    try:
        faults = STRAGGLER
        create_job(api, namespace, standin_job("on-uvloop", faults))
        wait_running(api, namespace, "on-uvloop", eventually)
        job = eventually(lambda: diagnosed(api, namespace, "on-uvloop", "Degraded"), 90, interval=1, what="Degraded")
        assert stored_diagnosis(job)["kind"] == "Straggler" and stored_diagnosis(job)["ranks"] == [5]
        assert "event loop: uvloop (uvloop)" in log.read_text()
    finally:
        processes.stop(runner)
        processes.stop(operator)


@pytest.mark.parametrize("gpu_timing", [True, False], ids=["gpu-timed", "untimed"])
def test_operator_restarted_mid_run_still_detects_and_posts_no_duplicates(
    api, kubeconfig, unwatched_namespace, processes, eventually, tmp_path, gpu_timing
):
    """Operator A diagnoses a straggler and is killed; B re-learns the job from the next summaries,
    reports nothing twice, and diagnoses the hang that follows (on cue, once B judges the job); C after
    it adds nothing. With host call times only the straggler is named on nobody (A only sees the
    telemetry flow): B's hang is the job's first finding."""
    namespace = unwatched_namespace
    port = processes.free_port()
    log = tmp_path / "operator.log"
    operator = processes.operator(kubeconfig, namespace, log, port)
    runner = processes.pod_runner(kubeconfig, f"http://127.0.0.1:{port}", namespace, tmp_path / "pods")

    def restart(operator):
        operator.send_signal(signal.SIGKILL)  # no chance to clean up
        operator.wait(10)
        return processes.operator(kubeconfig, namespace, log, port)

    def warnings(reason: str) -> int:
        return sum(e.reason == reason for e in events(api, namespace, "flaky"))

    try:
        cue = tmp_path / "hang"  # rank 5 hangs once it exists: after A's finding, however slow the machine
        faults = {**STRAGGLER, "RANKWATCH_STANDIN_HANG_WHEN_FILE": str(cue)}
        create_job(api, namespace, standin_job("flaky", faults, gpu_timing=gpu_timing))
        wait_running(api, namespace, "flaky", eventually)
        if gpu_timing:
            eventually(lambda: diagnosed(api, namespace, "flaky", "Degraded"), 120, interval=1, what="Degraded (A)")
            eventually(lambda: warnings("Straggler") == 1, 20, what="one Straggler Event")
        else:
            eventually(
                lambda: condition(get_job(api, namespace, "flaky"), "Degraded").get("reason") == "TelemetryHealthy",
                60,
                what="telemetry flowing (A)",
            )

        operator = restart(operator)  # B
        metrics = f"http://127.0.0.1:{port}/metrics"
        eventually(lambda: detector_runs(metrics, namespace, "flaky") >= 1, 60, what="B judging the job")
        cue.touch()
        job = eventually(lambda: diagnosed(api, namespace, "flaky", "Hung"), 120, interval=1, what="Hung (B)")
        assert stored_diagnosis(job)["kind"] == "Hang" and stored_diagnosis(job)["ranks"] == [5]
        if gpu_timing:
            degraded = condition(job, "Degraded")
            assert degraded["status"] == "False" and degraded["reason"] == "Superseded", degraded
        eventually(lambda: warnings("Hang") == 1, 20, what="one Hang Event")

        operator = restart(operator)  # C: the job is still hung; it must not say so again
        # C has seen the hang itself (its own counter, from its start), judged the job twice more since and
        # runs no diagnosis: were it to say so again, it would have by now
        eventually(
            lambda: operator_metric(metrics, "rankwatch_detector_suspicions_total", kind="hang") >= 1,
            4 * WINDOW + SENSITIVITY + 60,
            what="C suspecting the hang",
        )
        judge(metrics, namespace, ("flaky",), lambda: None, eventually, 2)
        job = get_job(api, namespace, "flaky")
        assert condition(job, "Hung")["status"] == "True"
        assert (warnings("Straggler"), warnings("Hang")) == (int(gpu_timing), 1), [
            (e.reason, e.message) for e in events(api, namespace, "flaky")
        ]
    finally:
        processes.stop(runner)
        processes.stop(operator)
        print(log.read_text()[-3000:])
