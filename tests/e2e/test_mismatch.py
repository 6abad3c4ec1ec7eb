"""A rank calls another collective than its peers, in the cluster: real operator (a process of its own,
paging the local Feishu), real sidecars and interposer, worker pods run by the pod runner on the stand-in
NCCL, whose members never complete a collective they disagree on (as with the real library). The job's
own code is at fault: the diagnosis says `CollectiveMismatch` naming the odd rank, its owner is paged,
and no node is cordoned although the job asks for cordons."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest
import yaml
from local_feishu import BOT_TOKEN, SIGNING_SECRET, Feishu
from trainingjobs import (
    SENSITIVITY,
    WINDOW,
    create_job,
    diagnosed,
    events,
    judge,
    node_marks,
    node_of_pod,
    operator_metric,
    report,
    standin_job,
    stored_diagnosis,
    wait_running,
)

pytestmark = pytest.mark.e2e

ODD_RANK = 5  # pod 1, the second TP group
ODD_CALLS = {  # what rank 5 calls where its TP peers all-reduce 4,096 x float32
    "op": "Broadcast of 4,096 x float32",
    "count": "Allreduce of 2,048 x float32",
    "dtype": "Allreduce of 4,096 x bfloat16",
}


@pytest.fixture
def paging_operator(api, kubeconfig, unwatched_namespace, processes, tmp_path) -> Iterator[tuple[str, Feishu, str]]:
    """The operator for one namespace, its alerts routed to the local Feishu; the pod runner. Yields the
    namespace, the local Feishu and the operator's /metrics."""
    namespace = unwatched_namespace
    feishu = Feishu()
    secret = {"webhook-url": feishu.fake.bot_url(BOT_TOKEN), "signing-secret": SIGNING_SECRET}
    kubernetes.client.CoreV1Api(api).create_namespaced_secret(
        namespace, {"metadata": {"name": "rankwatch-feishu"}, "stringData": secret}
    )

    def ref(key: str) -> dict[str, Any]:
        return {"secretKeyRef": {"name": "rankwatch-feishu", "key": key}}

    alerting = {
        "receivers": [
            {"name": "feishu", "feishu": {"webhook_url": ref("webhook-url"), "secret": ref("signing-secret")}}
        ],
        "route": {"receiver": "feishu", "group_wait": "1s", "group_interval": "5s", "repeat_interval": "4h"},
        "store": {"path": str(tmp_path / "alerts")},
    }
    (tmp_path / "alerting.yaml").write_text(yaml.safe_dump(alerting))
    settings = {
        "RANKWATCH_ALERTING_CONFIG": str(tmp_path / "alerting.yaml"),
        "POD_NAMESPACE": namespace,  # where the alerting Secrets are
        "RANKWATCH_CORDON_COOLDOWN_SECONDS": "0",  # the tests share four nodes
        "RANKWATCH_BREAKER_MAX_SHARE": "1",
    }
    port = processes.free_port()
    log = tmp_path / "operator.log"
    operator = processes.operator(kubeconfig, namespace, log, port, settings)
    runner = processes.pod_runner(kubeconfig, f"http://127.0.0.1:{port}", namespace, tmp_path / "pods")
    try:
        yield namespace, feishu, f"http://127.0.0.1:{port}/metrics"
    finally:
        processes.stop(runner)
        processes.stop(operator)
        feishu.stop()
        print(log.read_text(errors="replace")[-3000:])


def findings(metrics: str) -> int:
    """Diagnoses the operator ran that found something (written, or found already written)."""
    return int(operator_metric(metrics, "rankwatch_diagnoses_total", outcome="finding"))


def marked(api, node: str) -> bool:
    unschedulable, taints, marks = node_marks(api, node)
    return unschedulable or any(t.startswith("rankwatch.io/") for t in taints) or "rankwatch.io/cordon-job" in marks


@pytest.mark.parametrize("mismatch", sorted(ODD_CALLS))
def test_a_rank_calling_another_collective_is_a_mismatch_that_pages_and_cordons_nothing(
    api, paging_operator, eventually, mismatch
):
    namespace, feishu, metrics = paging_operator
    name = f"mismatch-{mismatch}"
    faults = {
        "RANKWATCH_STANDIN_FAULT_RANK": str(ODD_RANK),
        "RANKWATCH_STANDIN_MISMATCH_AT_CALL": "300",  # its first all-reduce from its 300th NCCL call on
        "RANKWATCH_STANDIN_MISMATCH": mismatch,
    }
    create_job(api, namespace, standin_job(name, faults, remediation={"cordon": True}))
    wait_running(api, namespace, name, eventually)
    job = eventually(lambda: diagnosed(api, namespace, name, "Degraded"), 120, interval=1, what="Degraded=True")
    diagnosis = stored_diagnosis(job)
    assert (diagnosis["kind"], diagnosis["ranks"], diagnosis["cause"]) == ("CollectiveMismatch", [ODD_RANK], "software")
    assert diagnosis["nodes"] == [node_of_pod(api, namespace, f"{name}-worker-1")], diagnosis
    finding = report(api, namespace, job)["findings"][0]
    assert finding["evidence"]["mismatch"] == [mismatch], finding["evidence"]
    assert finding["evidence"]["calls"][str(ODD_RANK)] == ODD_CALLS[mismatch], finding["evidence"]["calls"]
    assert not [f for f in report(api, namespace, job)["findings"] if f["kind"] == "hang"], "not also a hang"

    pages = eventually(lambda: feishu.pages("TrainingJobCollectiveMismatch"), 60, what="the page")
    assert len(pages) == 1 and pages[0].startswith("[P0]") and f"{namespace}/{name}" in pages[0], pages
    skipped = eventually(
        lambda: [e.message for e in events(api, namespace, name) if e.reason == "CordonSkipped"], 30, what="no cordon"
    )
    assert "called different collectives: a fault of the job's code" in skipped[0], skipped
    nodes = [n.metadata.name for n in kubernetes.client.CoreV1Api(api).list_node().items]
    assert not [n for n in nodes if marked(api, n)], "a node cordoned for the job's own code"
    if mismatch == "op":  # the job stays stalled: nothing is said twice, nothing cordoned later
        # The stall goes on being suspected a hang: the operator diagnoses the job again and finds the mismatch
        # it wrote; once it has (a second finding) and judged the job twice more with no diagnosis running,
        # anything it were to say twice it would have said.
        eventually(lambda: findings(metrics) >= 2, 4 * WINDOW + SENSITIVITY + 60, what="a second look at the job")
        judge(metrics, namespace, (name,), lambda: None, eventually, 2)
        said = [e.reason for e in events(api, namespace, name) if e.reason in ("CollectiveMismatch", "CordonSkipped")]
        assert sorted(said) == ["CollectiveMismatch", "CordonSkipped"], said
        assert feishu.pages("TrainingJobCollectiveMismatch") == pages
        assert not [n for n in nodes if marked(api, n)]
    print(f"{mismatch} mismatch: {diagnosis['summary']}; paged: {pages[0]}", file=sys.__stdout__)
