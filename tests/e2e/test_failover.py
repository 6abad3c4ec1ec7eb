"""Two operator replicas as the Helm chart installs them, run for real by the pod runner (processes,
readiness probes, Services through their EndpointSlices): the leader is SIGKILLed during a straggler
diagnosis and again during a hang diagnosis; the standby leads within 15 s, and each diagnosis is
written once, cordons once and pages once. Only the leader is ever a ready endpoint; the standby
does not even listen for summaries."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import pytest
import yaml
from alerting_support import BOT_TOKEN, SIGNING_SECRET
from local_feishu import Feishu
from operator_pods import Replicas, http, metric, refuses, start_pod_runner, tear_down_release
from trainingjobs import JOB_API, STRAGGLER, diagnosis_in, judge, standin_job

pytestmark = pytest.mark.e2e

CHART = Path(__file__).parents[2] / "helm" / "rankwatch"
LEASE_S, RENEW_DEADLINE_S = 8.0, 6.0  # the chart's leadership.leaseSeconds and renewDeadlineSeconds
# A standby may take the Lease only once it has seen no renewal for LEASE_S, and a leader that has not
# renewed for RENEW_DEADLINE_S stops acting: a takeover sooner than their difference after the kill means
# two leaders. How much later it comes is the machine's load: printed, not asserted (about 9-10 s quiet).
EARLIEST_TAKEOVER_S = LEASE_S - RENEW_DEADLINE_S


@pytest.fixture
def installed(helm, api, crd, kubeconfig, tmp_path) -> Iterator[tuple[Replicas, str, Feishu]]:
    """The chart in a namespace of its own watching one jobs namespace, alerting to the local Feishu,
    its pods and the jobs' pods run by the pod runner."""
    suffix = uuid.uuid4().hex[:6]
    release, namespace, jobs = f"ha-{suffix}", f"rw-ha-{suffix}", f"rw-hajobs-{suffix}"
    core = kubernetes.client.CoreV1Api(api)
    for name in (namespace, jobs):
        core.create_namespace({"metadata": {"name": name}})
    feishu = Feishu()
    secrets = {
        "rankwatch-feishu": {"webhook-url": feishu.fake.bot_url(BOT_TOKEN), "signing-secret": SIGNING_SECRET},
        "rankwatch-intake": {"token": "intake-token"},
    }
    for name, data in secrets.items():
        core.create_namespaced_secret(namespace, {"metadata": {"name": name}, "stringData": data})
    values = {
        "operator": {
            "namespaces": [jobs],
            "sidecarEndpointHosts": ["127.0.0.1"],  # the pod runner's sidecars (kwok pod IPs are not real)
            "safeguards": {"breakerMaxShare": 1.0, "cordonCooldownSeconds": 0},
        },
        "alerting": {
            "enabled": True,
            "config": {
                "receivers": [
                    {
                        "name": "feishu",
                        "feishu": {
                            "webhook_url": {"secretKeyRef": {"name": "rankwatch-feishu", "key": "webhook-url"}},
                            "secret": {"secretKeyRef": {"name": "rankwatch-feishu", "key": "signing-secret"}},
                        },
                    }
                ],
                "route": {"receiver": "feishu", "group_wait": "1s", "group_interval": "5s", "repeat_interval": "4h"},
                "store": {"configMap": "rankwatch-alerts"},
            },
        },
    }
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    helm("install", release, str(CHART), "--namespace", namespace, "--values", str(tmp_path / "values.yaml"))
    runner = start_pod_runner(kubeconfig, namespace, release, jobs, tmp_path)
    try:
        yield Replicas(api, namespace, release), jobs, feishu
    finally:
        tear_down_release(helm, api, release, namespace, jobs, runner, tmp_path, cordoned_by=("slow", "hang"))
        feishu.stop()


def leader_and_standby(replicas: Replicas, eventually) -> tuple[str, str]:
    """Both replicas up, exactly one leading and ready, the other waiting and not ready."""

    def settled() -> tuple[str, str] | None:
        pods = replicas.pods()
        holder = replicas.holder()
        if len(pods) != 2 or holder not in pods:
            return None
        (standby,) = set(pods) - {holder}
        if replicas.ready(pods[holder]) and not replicas.ready(pods[standby]):
            return holder, standby
        return None

    return eventually(settled, 90, interval=0.5, what="one leader and one standby")


def kill_during_diagnosis(replicas: Replicas, leader: str, eventually) -> tuple[float, str]:
    """SIGKILL the leader's process while it runs a diagnosis; the moment of the kill (monotonic, and
    as written in status times)."""
    pod = replicas.pods()[leader]
    eventually(lambda: metric(pod, "rankwatch_diagnoses_running") >= 1, 120, interval=0.05, what="a diagnosis running")
    os.kill(pod["pid"], signal.SIGKILL)
    return time.monotonic(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 1))


def takeover(replicas: Replicas, standby: str, killed_at: float, eventually) -> float:
    """Seconds from the kill until the standby holds the Lease and reports ready; meanwhile no
    Service ever has two ready endpoints."""

    def leading() -> bool:
        assert len(replicas.endpoints("collector")) <= 1
        return replicas.holder() == standby and replicas.ready(replicas.pods()[standby])

    eventually(leading, 60, interval=0.2, what=f"{standby} leading")
    return time.monotonic() - killed_at


def test_the_standby_takes_over_diagnoses_in_flight_and_repeats_nothing(installed, api, eventually):
    replicas, jobs, feishu = installed
    objects, core = kubernetes.client.CustomObjectsApi(api), kubernetes.client.CoreV1Api(api)
    leader, standby = leader_and_standby(replicas, eventually)
    pods = replicas.pods()
    for service in ("collector", "intake", "metrics"):
        assert eventually(lambda s=service: replicas.endpoints(s) == [leader], 20, what=f"{service} -> leader only")
    assert http(pods[standby], "health", "/readyz")[1].startswith("standby")
    assert refuses(pods[standby], "http"), "a standby does not even listen for summaries"

    timings = []
    for job, faults, reason, alertname in (
        ("slow", STRAGGLER, "Straggler",
         "TrainingJobStraggler"),
        ("hang", {"RANKWATCH_STANDIN_FAULT_RANK": "2", "RANKWATCH_STANDIN_HANG_BEFORE_CALL": "300"}, "Hang",
         "TrainingJobHang"),
    ):  # fmt: skip
        objects.create_namespaced_custom_object(
            *JOB_API[:2], jobs, JOB_API[2], standin_job(job, faults, remediation={"cordon": True})
        )
        killed_at, killed_time = kill_during_diagnosis(replicas, leader, eventually)
        timings.append(takeover(replicas, standby, killed_at, eventually))
        leader, standby = standby, leader
        assert eventually(lambda now=leader: replicas.endpoints("collector") == [now], 20, what="the Service follows")

        def written(job: str = job) -> dict | None:
            status = objects.get_namespaced_custom_object(*JOB_API[:2], jobs, JOB_API[2], job).get("status", {})
            diagnosis = diagnosis_in(status)
            return diagnosis if diagnosis.get("remediation") and diagnosis.get("alertedTime") else None

        diagnosis = eventually(written, 120, interval=1, what=f"{job}: diagnosis, cordon and alert recorded")
        assert diagnosis["kind"] in (reason, "StuckInCollective") and diagnosis["active"]
        assert diagnosis["time"] >= killed_time, "written by the new leader: the old one died before it could"
        (node,) = diagnosis["nodes"]
        eventually(lambda a=alertname: feishu.pages(a), 30, what=f"the {alertname} page")
        # anything repeated would come from another diagnosis: the leader judges the job twice more, runs none
        metrics = f"http://127.0.0.1:{replicas.pods()[leader]['ports']['metrics']}/metrics"
        judge(metrics, jobs, (job,), lambda: None, eventually, 2)
        warnings = [
            e
            for e in core.list_namespaced_event(jobs).items
            if e.involved_object.name == job and e.reason == diagnosis["kind"]
        ]
        assert len(warnings) == 1 and warnings[0].count == 1, "the diagnosis is written once"
        cordons = [
            e
            for e in core.list_namespaced_event("default").items
            if e.involved_object.name == node
            and e.reason == "CordonedByRankwatch"
            and f"TrainingJob {jobs}/{job} " in e.message
        ]
        assert len(cordons) == 1 and core.read_node(node).spec.unschedulable, "one cordon"
        assert len(feishu.pages(alertname)) == 1, "one page"
        assert job in diagnosis["remediation"] or node in diagnosis["remediation"]
        # The killed replica is back (restarted as a kubelet would) and waits; summaries reach the leader only.
        standby_pod = eventually(lambda s=standby: replicas.pods().get(s), 60, what="the killed replica restarted")
        eventually(lambda p=standby_pod: http(p, "health", "/readyz")[0] == 503, 30, what="restarted as standby")
        assert refuses(standby_pod, "http") and replicas.endpoints("collector") == [leader]
        assert metric(replicas.pods()[leader], 'rankwatch_collector_messages_total{kind="summary",result="accepted"}')

    print(f"takeover after SIGKILL of the leader: {', '.join(f'{t:.1f} s' for t in timings)}")
    assert all(t >= EARLIEST_TAKEOVER_S for t in timings), f"taken before the Lease could expire: {timings}"
