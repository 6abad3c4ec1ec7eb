"""Jobs of other kinds on the local cluster: the real operator serves the admission webhook on
loopback (the local API server runs on this host and calls it), registered with the chart's own
MutatingWebhookConfiguration; the real Job controller makes an Indexed Job's pods."""

from __future__ import annotations

import re
import urllib.request
from typing import Any

import kubernetes
import pytest
import yaml
from other_kinds import (
    HANG_IN_FIRST_ATTEMPT,
    JOBSET_API,
    PATIENCE_S,
    VOLCANO_API,
    assert_hang_handled,
    assert_straggler_handled,
    describe_cli,
    indexed_job,
    injected,
    owner_events,
    probe_pod,
    resumed_pods,
    second_look,
    secrets_made_while,
    settled_restart,
    standin_indexed_job,
    standin_jobset,
    start_operator,
    stop,
    volcano_job,
    volcano_pod,
    wait_for_webhook,
)
from trainingjobs import STRAGGLER

pytestmark = pytest.mark.e2e


def test_indexed_job_pods_are_injected_and_pods_made_while_the_operator_is_down_start_and_are_reported(
    webhook, chart_rbac_kubeconfig, processes, api, kubectl, unwatched_namespace, eventually, tmp_path
):
    port, certs = webhook
    namespace = unwatched_namespace
    core, batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
    log = tmp_path / "operator.log"
    collector_port = processes.free_port()

    def pods(job: str) -> list[kubernetes.client.V1Pod]:
        return core.list_namespaced_pod(namespace, label_selector=f"batch.kubernetes.io/job-name={job}").items

    operator = start_operator(processes, chart_rbac_kubeconfig, namespace, log, port, certs, collector_port)
    try:
        wait_for_webhook(kubectl, namespace, eventually)
        watched = batch.create_namespaced_job(namespace, indexed_job("watched", 2))
        both = eventually(lambda: len(pods("watched")) == 2 and pods("watched"), PATIENCE_S, what="the Job's 2 pods")
        for pod in both:
            assert injected(pod), f"{pod.metadata.name} was not injected"
            assert pod.metadata.annotations["rankwatch.io/tracing"] == "enabled"
            assert pod.metadata.labels["rankwatch.io/traced"] == "true", "the NetworkPolicies' peer"
            sidecar = next(c for c in pod.spec.init_containers if c.name == "rankwatch-sidecar")
            env = {e.name: e for e in sidecar.env}
            assert env["RANKWATCH_JOB_NAME"].value == "Job:watched" and env["RANKWATCH_NPROC_PER_NODE"].value == "2"
            index = env["RANKWATCH_REPLICA_INDEX"].value_from.field_ref.field_path
            assert index == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
            trainer = {e.name: e.value for e in pod.spec.containers[0].env}
            assert trainer["LD_PRELOAD"] == "/rankwatch/lib/librankwatch-nccl.so"
            assert "JOB_COMPLETION_INDEX" in trainer, "the Job controller's env is kept"
        secret = core.read_namespaced_secret("watched-rankwatch-job-token", namespace)
        assert [owner.uid for owner in secret.metadata.owner_references] == [watched.metadata.uid]
        assert secret.data["token"], "the group's sidecars have a token"
        eventually(
            lambda: all(p.status.phase == "Running" for p in pods("watched")),
            PATIENCE_S,
            what="the injected pods running",
        )

        # A dry run has no side effects (sideEffects: NoneOnDryRun): injected, but no token Secret made.
        held = indexed_job("held", 1)
        held["spec"]["suspend"] = True  # no pods of its own
        held = batch.create_namespaced_job(namespace, held)
        dry = probe_pod(namespace, "held")
        dry["metadata"]["ownerReferences"][0]["uid"] = held.metadata.uid
        answer = kubectl("create", "--dry-run=server", "-o", "yaml", "-f", "-", input=yaml.safe_dump(dry))
        assert "rankwatch-sidecar" in answer.stdout
        made = kubectl("get", "secret", "-n", namespace, "held-rankwatch-job-token", check=False)
        assert made.returncode != 0, "a Secret made by a dry run"

        # Owner references are whatever a pod's creator writes: no token Secret for a Job that does not exist.
        assert secrets_made_while(core, namespace, lambda: injected(
            core.create_namespaced_pod(namespace, probe_pod(namespace, "ghost"))
        )) == [], "a token Secret for a Job that does not exist"  # fmt: skip

        # A pod the webhook cannot inject is admitted as it is, says why, and its Job hears of it.
        refused = indexed_job("refused", 1)
        refused["spec"]["template"]["spec"]["containers"][0]["name"] = "rankwatch-sidecar"
        refused = batch.create_namespaced_job(namespace, refused)
        [pod] = eventually(lambda: pods("refused"), PATIENCE_S, what="the refused Job's pod")
        assert not injected(pod)
        why = f"Job {namespace}/refused: container name 'rankwatch-sidecar' is reserved for rankwatch"
        assert pod.metadata.annotations["rankwatch.io/not-injected"] == why

        def refused_reported() -> list[Any]:
            events = core.list_namespaced_event(namespace, field_selector="reason=Unwatched").items
            return [e for e in events if e.involved_object.uid == refused.metadata.uid and why in e.message]

        eventually(refused_reported, PATIENCE_S, what="the Unwatched Event on the refused Job, with the reason")

        stop(operator)
        # The webhook is gone: the API server gets no answer and, failing open, admits the pods as they are.
        unwatched = batch.create_namespaced_job(namespace, indexed_job("unwatched", 2))
        both = eventually(
            lambda: len(pods("unwatched")) == 2 and pods("unwatched"), PATIENCE_S, what="pods with no webhook"
        )
        assert not any(injected(pod) for pod in both)
        eventually(
            lambda: all(p.status.phase == "Running" for p in pods("unwatched")),
            PATIENCE_S,
            what="un-injected pods running",
        )
        names = sorted(pod.metadata.name for pod in both)

        operator = start_operator(processes, chart_rbac_kubeconfig, namespace, log, port, certs, collector_port)

        def reported() -> list[Any]:
            events = core.list_namespaced_event(namespace, field_selector="reason=Unwatched").items
            return [
                e
                for e in events
                if e.involved_object.uid == unwatched.metadata.uid and all(n in e.message for n in names)
            ]

        [event] = eventually(reported, PATIENCE_S, what="the Unwatched Event on the Job")
        assert event.type == "Warning" and event.involved_object.kind == "Job"
        assert event.message.startswith("2 of 2 opted-in pod(s)") and "operator was down" in event.message
        job = batch.read_namespaced_job("unwatched", namespace)
        assert job.metadata.annotations["rankwatch.io/unwatched-pods"] == "2"
        metrics = (
            urllib.request.urlopen(f"http://127.0.0.1:{collector_port}/metrics", timeout=PATIENCE_S).read().decode()
        )
        assert 'rankwatch_unwatched_pods{kind="Job"} 3.0' in metrics, "these two and the refused Job's pod"
        watched_events = core.list_namespaced_event(namespace, field_selector="reason=Unwatched").items
        assert not [e for e in watched_events if e.involved_object.uid == watched.metadata.uid], (
            "the injected Job is watched"
        )

        # Its pods gone (the Job suspended), the Job says so too.
        batch.patch_namespaced_job("unwatched", namespace, {"spec": {"suspend": True}})

        def annotation() -> str | None:
            return (batch.read_namespaced_job("unwatched", namespace).metadata.annotations or {}).get(
                "rankwatch.io/unwatched-pods"
            )

        eventually(lambda: annotation() is None, PATIENCE_S, what="the annotation gone with the unwatched pods")
        # an HTTP 403 or Forbidden, not a log line's timestamp that happens to hold 403 ms
        refused = re.compile(r"\b(HTTP )?403\b(?!\])|[Ff]orbidden")
        refused_calls = [line for line in log.read_text().splitlines() if refused.search(line.split("] ", 1)[-1])]
        assert not refused_calls, "the chart's RBAC lacks what the operator called"
    finally:
        if operator.poll() is None:
            stop(operator)


# ---- the same loop for a group of another kind: diagnosis, cordon, alert, written on the owner ----------


def test_a_straggler_in_an_indexed_job_is_diagnosed_cordoned_alerted_and_written_on_the_job(
    watching, kubeconfig, api, unwatched_namespace, eventually, alert_sink
):  # fmt: skip
    namespace = unwatched_namespace
    batch = kubernetes.client.BatchV1Api(api)
    with watching("slow"):
        job = batch.create_namespaced_job(namespace, standin_indexed_job("slow", STRAGGLER))

        def read() -> dict[str, Any]:
            return api.sanitize_for_serialization(batch.read_namespaced_job("slow", namespace))

        node = assert_straggler_handled(api, namespace, read, "Job", "slow", job.metadata.uid, alert_sink,
                                        eventually)  # fmt: skip
        pod = (
            kubernetes.client.CoreV1Api(api)
            .list_namespaced_pod(
                namespace,
                label_selector="batch.kubernetes.io/job-completion-index=1,batch.kubernetes.io/job-name=slow",
            )
            .items[0]
        )
        assert pod.spec.node_name == node, "rank 5 runs in the pod of completion index 1"


def test_a_straggler_in_a_jobset_run_by_the_real_controller_is_diagnosed_cordoned_alerted_and_written_on_it(
    watching, jobset_controller, kubeconfig, api, unwatched_namespace, eventually, alert_sink
):  # fmt: skip
    namespace = unwatched_namespace
    objects, core = kubernetes.client.CustomObjectsApi(api), kubernetes.client.CoreV1Api(api)
    with watching("slowset"):
        jobset = objects.create_namespaced_custom_object(
            *JOBSET_API[:2], namespace, JOBSET_API[2], standin_jobset("slowset", STRAGGLER)
        )
        uid = jobset["metadata"]["uid"]

        def read() -> dict[str, Any]:
            return objects.get_namespaced_custom_object(*JOBSET_API[:2], namespace, JOBSET_API[2], "slowset")

        selector = f"jobset.sigs.k8s.io/jobset-uid={uid}"
        pods = eventually(
            lambda: len(p := core.list_namespaced_pod(namespace, label_selector=selector).items) == 2 and p,
            PATIENCE_S,
            what="the JobSet controller's two child Jobs' pods",
        )  # fmt: skip
        assert all(injected(pod) for pod in pods), "the webhook injects a JobSet's pods"
        sidecar = next(c for c in pods[0].spec.init_containers if c.name == "rankwatch-sidecar")
        assert {e.name: e.value for e in sidecar.env}["RANKWATCH_JOB_NAME"] == "JobSet:slowset"
        token = core.read_namespaced_secret("slowset-rankwatch-jobset-token", namespace)
        assert [o.uid for o in token.metadata.owner_references] == [uid]

        node = assert_straggler_handled(api, namespace, read, "JobSet", "slowset", uid, alert_sink, eventually)
        described = describe_cli(kubeconfig, namespace, "jobset/slowset")
        assert "Kind:         JobSet (jobset.x-k8s.io/v1alpha2)" in described and "Health:       Degraded" in described
        assert "  Kind:        Straggler" in described and f"  Nodes:       {node}" in described
        assert f"  Remediation: cordoned and tainted {node}" in described
        assert re.search(r"Warning\s+Straggler\s+\S+\s+rankwatch-operator\s+rank 5", described), described
        [slow_pod] = [p for p in pods if p.spec.node_name == node]
        assert slow_pod.metadata.labels["jobset.sigs.k8s.io/job-global-index"] == "1"


def test_a_straggler_in_a_volcano_job_is_diagnosed_cordoned_alerted_and_written_on_it(
    watching, volcano_crd, kubeconfig, api, unwatched_namespace, eventually, alert_sink
):  # fmt: skip
    namespace = unwatched_namespace
    objects, core = kubernetes.client.CustomObjectsApi(api), kubernetes.client.CoreV1Api(api)
    with watching("vslow"):
        job = objects.create_namespaced_custom_object(
            *VOLCANO_API[:2], namespace, VOLCANO_API[2], volcano_job("vslow", STRAGGLER)
        )
        uid = job["metadata"]["uid"]
        for index in range(2):
            pod = core.create_namespaced_pod(namespace, volcano_pod(job, index))
            assert injected(pod)
        sidecar = next(c for c in pod.spec.init_containers if c.name == "rankwatch-sidecar")
        assert {e.name: e.value for e in sidecar.env}["RANKWATCH_JOB_NAME"] == "VolcanoJob:vslow"

        def read() -> dict[str, Any]:
            return objects.get_namespaced_custom_object(*VOLCANO_API[:2], namespace, VOLCANO_API[2], "vslow")

        node = assert_straggler_handled(
            api, namespace, read, "Job", "vslow", uid, alert_sink, eventually, alert_kind="VolcanoJob"
        )
        assert core.read_namespaced_pod("vslow-worker-1", namespace).spec.node_name == node
        described = describe_cli(kubeconfig, namespace, "vcjob/vslow")
        assert "Kind:         VolcanoJob (batch.volcano.sh/v1alpha1)" in described
        assert f"  Remediation: cordoned and tainted {node}" in described


def test_a_rank_that_never_calls_hangs_a_jobset_and_is_named_on_it(
    watching, jobset_controller, kubeconfig, api, unwatched_namespace, eventually, alert_sink
):  # fmt: skip
    namespace = unwatched_namespace
    objects = kubernetes.client.CustomObjectsApi(api)
    hang = {"RANKWATCH_STANDIN_FAULT_RANK": "2", "RANKWATCH_STANDIN_HANG_BEFORE_CALL": "300"}
    with watching("stuck"):
        jobset = objects.create_namespaced_custom_object(
            *JOBSET_API[:2], namespace, JOBSET_API[2], standin_jobset("stuck", hang)
        )
        uid = jobset["metadata"]["uid"]

        def read_stuck() -> dict[str, Any]:
            return objects.get_namespaced_custom_object(*JOBSET_API[:2], namespace, JOBSET_API[2], "stuck")

        assert_hang_handled(api, namespace, read_stuck, "JobSet", "stuck", uid, alert_sink, eventually)

        # No failurePolicy: a failed child Job would fail the whole JobSet, so it is cordon and page only.
        def read() -> dict[str, Any]:
            return objects.get_namespaced_custom_object(*JOBSET_API[:2], namespace, JOBSET_API[2], "stuck")

        skipped = eventually(lambda: settled_restart(read), PATIENCE_S, interval=1, what="the restart decided")
        assert skipped["restart"].startswith("not restarted: the JobSet has no spec.failurePolicy"), skipped
        assert skipped["active"] is True, "the finding stands: nothing restarted the job"
        [event] = eventually(lambda: owner_events(api, namespace, uid, "RestartSkipped"), PATIENCE_S, what="Event")
        assert event.type == "Normal" and "no spec.failurePolicy" in event.message
        assert not (read().get("status") or {}).get("restarts")


# ---- the group restarts away from the suspects with its kind's own lever --------------------------------


def test_a_hang_in_a_jobset_restarts_the_whole_group_through_its_failure_policy_away_from_the_node(
    watching, jobset_controller, kubeconfig, api, unwatched_namespace, eventually, alert_sink
):  # fmt: skip
    from rankwatch.operator.kinds.adapter import Group

    namespace = unwatched_namespace
    objects, core = kubernetes.client.CustomObjectsApi(api), kubernetes.client.CoreV1Api(api)
    manifest = standin_jobset("rerun", HANG_IN_FIRST_ATTEMPT)
    manifest["spec"]["failurePolicy"] = {"maxRestarts": 2}
    trainer = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    trainer["env"].append({"name": "RANKWATCH_ATTEMPT", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.labels['jobset.sigs.k8s.io/restart-attempt']"}}})  # fmt: skip
    with watching("rerun"):
        jobset = objects.create_namespaced_custom_object(*JOBSET_API[:2], namespace, JOBSET_API[2], manifest)
        uid = jobset["metadata"]["uid"]

        def read() -> dict[str, Any]:
            return objects.get_namespaced_custom_object(*JOBSET_API[:2], namespace, JOBSET_API[2], "rerun")

        record = eventually(lambda: settled_restart(read), PATIENCE_S, interval=1, what="the JobSet's restart")
        assert record["kind"] == "Hang" and record["ranks"] == [2], record
        [node] = record["nodes"]
        assert record["remediation"] == f"cordoned and tainted {node}"
        assert record["restart"].startswith("ended child Job rerun-workers-0 (activeDeadlineSeconds)"), record
        assert "restart 1 of at most 2" in record["restart"] and record["active"] is False
        [event] = eventually(lambda: owner_events(api, namespace, uid, "Restarting"), PATIENCE_S, what="Restarting")
        assert event.type == "Warning" and node in event.message

        # The JobSet controller restarted it: its counter moved, every child Job is of the new attempt.
        eventually(lambda: (read().get("status") or {}).get("restarts") == 1, PATIENCE_S, what="status.restarts 1")
        selector = f"jobset.sigs.k8s.io/jobset-uid={uid},jobset.sigs.k8s.io/restart-attempt=1"

        def new_pods() -> list[Any]:
            pods = core.list_namespaced_pod(namespace, label_selector=selector).items
            return len(pods) == 2 and all(p.status.phase == "Running" for p in pods) and pods

        pods = eventually(new_pods, PATIENCE_S, what="the restarted JobSet's 2 pods running")
        assert node not in {pod.spec.node_name for pod in pods}, "a restarted pod landed on the cordoned node"
        assert all(injected(pod) for pod in pods)
        assert read()["status"].get("restartsCountTowardsMax") == 1, "counted against failurePolicy.maxRestarts"

        eventually(lambda: read()["metadata"]["annotations"].get("rankwatch.io/health") == "Healthy", PATIENCE_S,
                   what="the restarted JobSet watched again, healthy")  # fmt: skip
        second_look(api, Group("jobset.x-k8s.io/v1alpha2", "JobSet", "jobsets", namespace, "rerun", uid), read)
        assert read()["status"]["restarts"] == 1


def test_a_hang_in_an_indexed_job_restarts_it_through_suspend_away_from_the_node(
    watching, kubeconfig, api, unwatched_namespace, eventually, alert_sink
):  # fmt: skip
    from rankwatch.operator.kinds.adapter import Group

    namespace = unwatched_namespace
    batch, core = kubernetes.client.BatchV1Api(api), kubernetes.client.CoreV1Api(api)
    with watching("rerun-job"):
        job = batch.create_namespaced_job(namespace, standin_indexed_job("rerun-job", HANG_IN_FIRST_ATTEMPT))
        uid = job.metadata.uid

        def read() -> dict[str, Any]:
            return api.sanitize_for_serialization(batch.read_namespaced_job("rerun-job", namespace))

        def pods() -> list[Any]:
            return core.list_namespaced_pod(namespace, label_selector=f"batch.kubernetes.io/controller-uid={uid}").items

        first = {pod.metadata.uid for pod in eventually(lambda: len(pods()) == 2 and pods(), PATIENCE_S, what="pods")}
        record = eventually(lambda: settled_restart(read), PATIENCE_S, interval=1, what="the Job's restart")
        assert record["kind"] == "Hang" and record["ranks"] == [2], record
        [node] = record["nodes"]
        assert record["restart"].startswith("suspended the Job"), record
        assert "restart 1 of at most 3" in record["restart"]
        assert read()["metadata"]["annotations"]["rankwatch.io/restarts"] == "1"

        restarted = eventually(lambda: resumed_pods(read, pods, first, 2), PATIENCE_S,
                               what="the Job resumed, 2 new pods running")  # fmt: skip
        assert node not in {pod.spec.node_name for pod in restarted}, "a restarted pod landed on the cordoned node"
        assert not {pod.metadata.uid for pod in pods()} & first, "every pod of the hung attempt ended"
        assert (read().get("status") or {}).get("failed", 0) == 0, "the suspend counts no failure"
        [event] = eventually(lambda: owner_events(api, namespace, uid, "Restarting"), PATIENCE_S, what="Restarting")
        assert event.involved_object.kind == "Job"

        eventually(lambda: read()["metadata"]["annotations"].get("rankwatch.io/health") == "Healthy", PATIENCE_S,
                   what="the restarted Job watched again, healthy")  # fmt: skip
        described = describe_cli(kubeconfig, namespace, "job/rerun-job")
        assert f"  Restart:     {record['restart']}" in described and "  Active:      false" in described
        assert re.search(r"Warning\s+Restarting\s+\S+\s+rankwatch-operator\s+Hang on " + node, described), described

        second_look(api, Group("batch/v1", "Job", "jobs", namespace, "rerun-job", uid), read)
        assert read()["metadata"]["annotations"]["rankwatch.io/restarts"] == "1"
        assert not read()["spec"].get("suspend")


def test_a_hang_in_a_volcano_job_gets_the_restartjob_command_volcanos_controller_takes(
    watching, volcano_commands, kubeconfig, api, unwatched_namespace, eventually, alert_sink
):  # fmt: skip
    from rankwatch.cluster.jobset import module_source
    from rankwatch.operator.kinds.adapter import Group

    namespace = unwatched_namespace
    objects, core = kubernetes.client.CustomObjectsApi(api), kubernetes.client.CoreV1Api(api)
    with watching("vhang"):
        job = objects.create_namespaced_custom_object(
            *VOLCANO_API[:2], namespace, VOLCANO_API[2], volcano_job("vhang", HANG_IN_FIRST_ATTEMPT)
        )
        uid = job["metadata"]["uid"]
        for index in range(2):
            core.create_namespaced_pod(namespace, volcano_pod(job, index))

        def read() -> dict[str, Any]:
            return objects.get_namespaced_custom_object(*VOLCANO_API[:2], namespace, VOLCANO_API[2], "vhang")

        record = eventually(lambda: settled_restart(read), PATIENCE_S, interval=1, what="the Volcano Job's restart")
        assert record["kind"] == "Hang" and record["ranks"] == [2], record
        [command] = objects.list_namespaced_custom_object("bus.volcano.sh", "v1alpha1", namespace, "commands")["items"]
        assert record["restart"].startswith(f"created Volcano Command {command['metadata']['name']} (RestartJob)")
        assert command["metadata"]["name"].startswith("vhang-restartjob-"), "vcctl's name prefix"
        # What Volcano's job controller reads (v1.10.0 job_controller.go: the Command informer's filter;
        # job_controller_handler.go processNextCommand: the action, the target's name), as the API
        # server stored it under Volcano's own CRD (nothing pruned).
        target = {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "name": "vhang", "uid": uid,
                  "controller": True, "blockOwnerDeletion": True}  # fmt: skip
        assert command["target"] == target and command["metadata"]["ownerReferences"] == [target]
        assert command["action"] == "RestartJob"
        actions = module_source("volcano.sh/apis", "v1.10.0") / "pkg/apis/bus/v1alpha1/actions.go"
        assert 'RestartJobAction Action = "RestartJob"' in actions.read_text()

        group = Group("batch.volcano.sh/v1alpha1", "Job", "jobs", namespace, "vhang", uid, "VolcanoJob")
        second_look(api, group, read)
        commands = objects.list_namespaced_custom_object("bus.volcano.sh", "v1alpha1", namespace, "commands")
        assert len(commands["items"]) == 1, "one RestartJob Command for one diagnosis"


def test_a_job_rankwatch_left_suspended_is_resumed_by_the_next_operator_and_no_other(
    watching, kubeconfig, api, unwatched_namespace, eventually, alert_sink
):  # fmt: skip
    """An operator that stopped between suspending an Indexed Job and resuming it: the next one resumes
    it (the mark on the Job, not memory, says so); a Job its user suspended stays suspended."""
    namespace = unwatched_namespace
    batch = kubernetes.client.BatchV1Api(api)
    for name, marks in (("left", {"rankwatch.io/restart-suspended": "2026-11-28T18:00:00Z"}), ("held", {})):
        manifest = indexed_job(name, 2)
        manifest["metadata"]["annotations"] = marks
        manifest["spec"]["suspend"] = True
        batch.create_namespaced_job(namespace, manifest)
    with watching("left"):

        def resumed() -> bool:
            job = batch.read_namespaced_job("left", namespace)
            return not job.spec.suspend and "rankwatch.io/restart-suspended" not in (job.metadata.annotations or {})

        eventually(resumed, PATIENCE_S, what="the Job rankwatch suspended resumed")
        assert batch.read_namespaced_job("held", namespace).spec.suspend, "the user's suspend is the user's"
