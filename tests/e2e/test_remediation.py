"""Remediation on the local cluster: real Nodes (kwok), real TrainingJobs, real pods bound to the nodes.

The diagnosis is given (a CordonRequest); what is under test is what happens to the nodes, the Events
a person sees, the undo (CLI and annotation) and the RBAC it needs. Every test leaves the nodes as
it found them.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import datetime
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import kubernetes
import pytest
import yaml
from api_relay import ApiRelay
from cordons import GPU_NODES, bare_pod, job_on_nodes, policy, reset_node, suspect
from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry

from rankwatch.cluster.nodes import MANAGED_LABEL, fake_gpu_node
from rankwatch.kube import TimedApiClient
from rankwatch.operator.config import BreakerSettings
from rankwatch.operator.remediation import node_actions, node_marks
from rankwatch.operator.remediation.cordon import (
    Outcome,
    Safeguards,
    expire_cordons,
    remediate,
    uncordon,
)
from rankwatch.operator.remediation.metrics import RemediationMetrics

pytestmark = pytest.mark.e2e

REPO = Path(__file__).parents[2]
EXTRA_LABEL = "rankwatch.io/e2e-extra-node"
NODE_PATCH = ("PATCH", r"^/api/v1/nodes/[^/?]+(\?|$)", None)


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def core(api):
    return kubernetes.client.CoreV1Api(api)


@pytest.fixture
def clean_nodes(core):
    """The GPU nodes untouched and without rankwatch Events before; as found after; extra nodes deleted."""
    for name in GPU_NODES:
        reset_node(core, name)
        for event in node_events(core, name):
            core.delete_namespaced_event(event.metadata.name, "default")
    yield
    for node in core.list_node(label_selector=EXTRA_LABEL).items:
        core.delete_node(node.metadata.name)
    for name in GPU_NODES:
        reset_node(core, name)


def node_events(core, node: str, reason: str | None = None):
    events = core.list_namespaced_event("default", field_selector=f"involvedObject.name={node}").items
    return [e for e in events if e.source.component == "rankwatch-operator" and reason in (None, e.reason)]


def job_events(core, namespace: str, job: str, reason: str | None = None):
    events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={job}").items
    return [e for e in events if reason in (None, e.reason)]


def is_untouched(node) -> bool:
    annotations = node.metadata.annotations or {}
    return (
        not node.spec.unschedulable
        and not any(t.key == node_marks.TAINT_KEY for t in node.spec.taints or [])
        and not any(key in annotations for key in node_marks.MARK_ANNOTATIONS)
    )


# ---- cordoning --------------------------------------------------------------------------------


def test_straggler_on_one_node_cordons_taints_and_annotates_only_that_node(
    api, core, kubectl, unwatched_namespace, clean_nodes
):
    namespace = unwatched_namespace
    job = job_on_nodes(api, namespace, "llama", GPU_NODES[:3])
    # gpu-node-3 ran no pod of the job: named by mistake, it must be refused.
    result = remediate(api, suspect(job, "gpu-node-1", "gpu-node-3"), policy())

    assert {d.node: d.outcome for d in result.decisions} == {
        "gpu-node-1": Outcome.CORDONED,
        "gpu-node-3": Outcome.NOT_JOB_NODE,
    }
    node = core.read_node("gpu-node-1")
    assert node.spec.unschedulable is True
    taints = [t for t in node.spec.taints if t.key == "rankwatch.io/suspect"]
    assert [(t.value, t.effect) for t in taints] == [(f"{namespace}.llama", "NoSchedule")]
    annotations = node.metadata.annotations
    assert annotations["rankwatch.io/cordoned-by"] == "rankwatch"
    assert annotations["rankwatch.io/cordon-reason"] == "straggler"
    assert annotations["rankwatch.io/cordon-job"] == f"{namespace}/llama"
    assert annotations["rankwatch.io/cordon-job-uid"] == job.job_uid
    assert annotations["rankwatch.io/was-unschedulable"] == "false"
    assert annotations["rankwatch.io/cordon-evidence"].startswith("rank 13 is 24% slower {")
    assert node_marks.parse_time(annotations["rankwatch.io/cordon-time"]) is not None
    for other in ("gpu-node-0", "gpu-node-2", "gpu-node-3"):
        assert is_untouched(core.read_node(other)), other

    [event] = node_events(core, "gpu-node-1", "CordonedByRankwatch")
    assert event.type == "Warning" and f"TrainingJob {namespace}/llama" in event.message
    assert event.reporting_component == "rankwatch-operator"
    described_node = kubectl("describe", "node", "gpu-node-1").stdout
    assert f"rankwatch.io/suspect={namespace}.llama:NoSchedule" in described_node
    assert "CordonedByRankwatch" in described_node and re.search(r"Unschedulable:\s+true", described_node)
    describe = kubectl("describe", "trainingjob", "-n", namespace, "llama").stdout
    assert "NodeCordoned" in describe and "cordoned and tainted gpu-node-1" in describe
    assert "CordonRefused" in describe and "no pod of" in describe


def test_a_bare_pod_carrying_the_jobs_label_does_not_make_another_node_the_jobs(
    api, core, unwatched_namespace, clean_nodes
):
    """The attack: a tenant binds a labelled pod to another team's node and gets a diagnosis to name it."""
    job = job_on_nodes(api, unwatched_namespace, "llama", GPU_NODES[:2])
    labels = {"rankwatch.io/job-name": "llama", "rankwatch.io/replica-index": "7"}
    bare_pod(api, unwatched_namespace, "llama-worker-7", "gpu-node-3", labels)

    result = remediate(api, suspect(job, "gpu-node-3", "gpu-node-1"), policy())

    assert {d.node: d.outcome for d in result.decisions} == {
        "gpu-node-3": Outcome.NOT_JOB_NODE,
        "gpu-node-1": Outcome.CORDONED,
    }
    assert is_untouched(core.read_node("gpu-node-3"))


def test_a_node_shared_with_another_namespace_is_cordoned_only_until_the_expiry(
    api, core, unwatched_namespace, clean_nodes
):
    other = f"rw-own-other-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": other}})
    try:
        job = job_on_nodes(api, unwatched_namespace, "llama", GPU_NODES[:2])
        bare_pod(api, other, "their-trainer", "gpu-node-1", {"app": "theirs"})
        expiry = Safeguards(breaker=BreakerSettings(max_share=1.0), shared_expiry_seconds=600)
        own_only = not node_actions.shared_with_others(api, "gpu-node-0", unwatched_namespace)

        result = remediate(api, suspect(job, "gpu-node-0", "gpu-node-1"), policy(expiry))

        assert result.cordoned == ("gpu-node-0", "gpu-node-1")
        shared = core.read_node("gpu-node-1").metadata.annotations
        cordoned_at = node_marks.parse_time(shared["rankwatch.io/cordon-time"])
        expires = node_marks.parse_time(shared["rankwatch.io/cordon-expires-at"])
        assert expires - cordoned_at == datetime.timedelta(seconds=600)
        if own_only:  # no other namespace's pod there (the cluster is shared with other tests)
            assert "rankwatch.io/cordon-expires-at" not in core.read_node("gpu-node-0").metadata.annotations

        assert expire_cordons(api, now=expires - datetime.timedelta(seconds=1)) == []
        undone = expire_cordons(api, now=expires)
        assert [(r.node, r.undone) for r in undone if r.node == "gpu-node-1"] == [("gpu-node-1", True)]
        assert is_untouched(core.read_node("gpu-node-1"))
        assert core.read_node("gpu-node-0").spec.unschedulable is True or not own_only
        assert job_events(core, unwatched_namespace, "llama", "NodeUncordoned")
    finally:
        core.delete_namespace(other)


def test_running_again_after_a_restart_changes_nothing_and_posts_no_new_event(
    api, core, unwatched_namespace, clean_nodes
):
    job = job_on_nodes(api, unwatched_namespace, "llama", GPU_NODES[:2])
    first = remediate(api, suspect(job, "gpu-node-0"), policy())
    version = core.read_node("gpu-node-0").metadata.resource_version
    # Nothing is remembered in the process: a new operator reads the same state from the node.
    again = [remediate(api, suspect(job, "gpu-node-0"), policy()) for _ in range(2)]

    assert first.cordoned == ("gpu-node-0",)
    assert [r.decisions[0].outcome for r in again] == [Outcome.ALREADY_CORDONED] * 2
    assert core.read_node("gpu-node-0").metadata.resource_version == version
    assert len(node_events(core, "gpu-node-0")) == 1
    assert len(job_events(core, unwatched_namespace, "llama", "NodeCordoned")) == 1


@pytest.fixture
def relay(kubeconfig, tmp_path):
    """The API server through a relay that can answer a request with an error or lose its answer."""
    if os.environ.get("RANKWATCH_USE_KUBECONFIG") == "1":
        pytest.skip("the relay serves with the built-in local cluster's certificates")
    from rankwatch.cluster.local import LocalCluster

    root = os.environ.get("RANKWATCH_TEST_CLUSTER_DIR") or os.path.expanduser("~/.rankwatch/test-cluster")
    relay = ApiRelay(Path(kubeconfig), LocalCluster(Path(root)).pki, tmp_path / "relay")
    yield relay
    relay.close()


def test_a_cordon_answered_503_then_its_answer_lost_is_finished_by_its_tries_with_one_event(
    core, api, relay, unwatched_namespace, clean_nodes, tmp_path
):
    """The node patch meets a 503 (tried again), then a partition that lets it land but loses its answer
    (a timeout, tried again: 409, the node changed): the cordon finds its own mark and posts its Events,
    once, and the operator's next follow-up of the same diagnosis posts nothing more."""
    job = job_on_nodes(api, unwatched_namespace, "llama", GPU_NODES[:2])
    request = dataclasses.replace(suspect(job, "gpu-node-1"), diagnosis="2026-11-26T19:00:00.000000Z")
    refused = relay.answer(*NODE_PATCH, 503)
    lost = relay.lose_answer(*NODE_PATCH)
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(
        str(relay.kubeconfig(tmp_path / "kubeconfig")), client_configuration=configuration
    )
    through_relay = TimedApiClient(configuration, request_timeout=2.0)

    result = remediate(through_relay, request, policy())
    again = remediate(through_relay, request, policy())

    assert refused.is_set() and lost.is_set()
    assert [method for method, _ in relay.requests].count("PATCH") == 3, relay.requests
    assert [(d.node, d.outcome) for d in result.decisions] == [("gpu-node-1", Outcome.CORDONED)]
    assert [(d.outcome, d.resumed) for d in again.decisions] == [(Outcome.CORDONED, True)]
    node = core.read_node("gpu-node-1")
    assert node.spec.unschedulable and node.metadata.annotations["rankwatch.io/cordon-job"] == request.job
    [event] = node_events(core, "gpu-node-1", "CordonedByRankwatch")
    assert (event.count or 1) == 1 and "cordoned and tainted gpu-node-1" in event.message
    assert len(job_events(core, unwatched_namespace, "llama", "NodeCordoned")) == 1
    assert is_untouched(core.read_node("gpu-node-0"))


def test_dry_run_annotates_and_posts_events_but_cordons_nothing(api, core, unwatched_namespace, clean_nodes):
    job = job_on_nodes(api, unwatched_namespace, "llama", GPU_NODES[:2], dryRun=True)
    result = remediate(api, suspect(job, "gpu-node-1"), policy(dryRun=True))
    remediate(api, suspect(job, "gpu-node-1"), policy(dryRun=True))

    assert result.dry_run and result.decisions[0].outcome is Outcome.DRY_RUN and result.cordoned == ()
    node = core.read_node("gpu-node-1")
    assert not node.spec.unschedulable
    assert not any(t.key == node_marks.TAINT_KEY for t in node.spec.taints or [])
    assert node.metadata.annotations["rankwatch.io/dry-run"] == "true"
    assert "rankwatch.io/cordoned-by" not in node.metadata.annotations
    [event] = node_events(core, "gpu-node-1")
    assert event.reason == "CordonDryRun" and event.message.startswith("dry run: rankwatch would cordon")
    assert len(job_events(core, unwatched_namespace, "llama", "NodeCordonDryRun")) == 1


def test_opted_out_node_and_per_job_limit_are_respected(api, core, unwatched_namespace, clean_nodes):
    core.patch_node("gpu-node-0", {"metadata": {"labels": {"rankwatch.io/remediation": "disabled"}}})
    job = job_on_nodes(api, unwatched_namespace, "llama", GPU_NODES, maxNodesPerJob=1)
    result = remediate(api, suspect(job, "gpu-node-0", "gpu-node-1", "gpu-node-2"), policy(maxNodesPerJob=1))

    assert {d.node: d.outcome for d in result.decisions} == {
        "gpu-node-0": Outcome.OPTED_OUT,
        "gpu-node-1": Outcome.CORDONED,
        "gpu-node-2": Outcome.JOB_LIMIT,
    }
    assert [n for n in GPU_NODES if core.read_node(n).spec.unschedulable] == ["gpu-node-1"]
    skipped = job_events(core, unwatched_namespace, "llama", "CordonSkipped")
    assert sorted(e.message.split(":")[0] for e in skipped) == [
        "did not cordon gpu-node-0",
        "did not cordon gpu-node-2",
    ]


def _extra_nodes(core, count: int) -> list[str]:
    """kwok-run nodes that no other test's pod is scheduled to (tainted) and the cluster tool leaves alone."""
    names = []
    for index in range(count):
        node = copy.deepcopy(fake_gpu_node(100 + index))
        name = f"rw-extra-{uuid.uuid4().hex[:6]}"
        node["metadata"]["name"] = name
        labels = node["metadata"]["labels"]
        labels.pop(MANAGED_LABEL)
        labels.update({"kubernetes.io/hostname": name, EXTRA_LABEL: "true"})
        node["spec"] = {"taints": [{"key": "rankwatch.io/e2e-only", "value": "true", "effect": "NoSchedule"}]}
        core.create_node(node)
        names.append(name)
    return names


def test_circuit_breaker_caps_cordons_when_many_jobs_blame_many_nodes(
    api, core, unwatched_namespace, clean_nodes, monkeypatch
):
    extra = _extra_nodes(core, 16)
    total = len(core.list_node().items)
    breaker = BreakerSettings(max_share=0.10, min_nodes=1, window_seconds=600)
    cap = breaker.cap(total)
    guarded = Safeguards(breaker=breaker)
    blamed = [*GPU_NODES, *extra][:12]
    jobs = [
        suspect(
            job_on_nodes(api, unwatched_namespace, f"job-{i}", blamed[2 * i : 2 * i + 2]), *blamed[2 * i : 2 * i + 2]
        )
        for i in range(6)
    ]

    registry = CollectorRegistry()
    metrics = RemediationMetrics(registry)

    def all_at_once() -> tuple[list[str], list]:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            results = list(
                pool.map(lambda s: remediate(api, s, policy(guarded, maxNodesPerJob=2), metrics=metrics), jobs)
            )
        return [n.metadata.name for n in core.list_node().items if n.spec.unschedulable], results

    cordoned, results = all_at_once()
    assert len(cordoned) == cap, (cordoned, cap, total)
    assert sorted(cordoned) == sorted(n for r in results for n in r.cordoned)
    refused = [d for r in results for d in r.decisions if d.outcome is Outcome.BREAKER_OPEN]
    assert len(refused) == 12 - cap
    assert registry.get_sample_value("rankwatch_circuit_breaker_tripped") == 1
    tripped = [r.request.job_name for r in results if r.breaker_open]
    warnings = job_events(core, unwatched_namespace, tripped[0], "CircuitBreakerOpen")
    assert warnings and warnings[0].type == "Warning" and "circuit breaker open" in warnings[0].message

    # A tripped breaker never blocks the undo.
    assert all(uncordon(api, name).undone for name in cordoned)
    assert not [n.metadata.name for n in core.list_node().items if n.spec.unschedulable]

    # As operator replicas would, without a shared lock: the re-count after writing still keeps
    # the cap (racing replicas may take back more than needed; the next diagnosis tries again).
    for name in blamed:
        reset_node(core, name)
    monkeypatch.setattr("rankwatch.operator.remediation.cordon._LOCK", _NoLock())
    cordoned, results = all_at_once()
    assert len(cordoned) <= cap, (cordoned, cap, total)
    assert sorted(cordoned) == sorted(n for r in results for n in r.cordoned)


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None


# ---- undo -------------------------------------------------------------------------------------


def test_uncordon_cli_restores_prior_state(api, core, kubeconfig, unwatched_namespace, clean_nodes):
    job = job_on_nodes(api, unwatched_namespace, "llama", GPU_NODES[:2])
    core.patch_node("gpu-node-1", {"spec": {"unschedulable": True}})  # someone else's cordon, before rankwatch
    result = remediate(api, suspect(job, "gpu-node-0", "gpu-node-1"), policy())
    assert [d.outcome for d in result.decisions] == [Outcome.CORDONED, Outcome.TAINTED]

    env = {**os.environ, "KUBECONFIG": kubeconfig}
    run = subprocess.run(
        [sys.executable, "-m", "rankwatch", "uncordon", "--all-from-job", f"{unwatched_namespace}/llama"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "gpu-node-0: uncordoned gpu-node-0" in run.stdout
    assert "gpu-node-1: removed rankwatch's taint" in run.stdout and "stays unschedulable" in run.stdout

    node0, node1 = core.read_node("gpu-node-0"), core.read_node("gpu-node-1")
    assert is_untouched(node0) and node1.spec.unschedulable is True
    assert not any(t.key == node_marks.TAINT_KEY for t in node1.spec.taints or [])
    assert node_marks.UNCORDONED_AT in node0.metadata.annotations
    assert len(node_events(core, "gpu-node-0", "UncordonedByRankwatch")) == 1
    assert len(job_events(core, unwatched_namespace, "llama", "NodeUncordoned")) == 2

    # The cooldown keeps a diagnosis still in flight from cordoning the node again at once.
    again = remediate(api, suspect(job, "gpu-node-0"), policy())
    assert again.decisions[0].outcome is Outcome.COOLDOWN

    run = subprocess.run(
        [sys.executable, "-m", "rankwatch", "uncordon", "gpu-node-3"], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0 and "not cordoned by rankwatch" in run.stdout


def test_nodes_cli_lists_what_rankwatch_cordoned_for_which_job_since_when(
    api, core, kubeconfig, unwatched_namespace, clean_nodes
):
    env = {**os.environ, "KUBECONFIG": kubeconfig}

    def nodes(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rankwatch", "nodes", *args], capture_output=True, text=True,
                              env=env, timeout=60)  # fmt: skip

    empty = nodes()
    assert empty.returncode == 0 and empty.stdout.strip() == "no node carries rankwatch's mark", empty.stderr
    job = job_on_nodes(api, unwatched_namespace, "llama", GPU_NODES[:2])
    core.patch_node("gpu-node-1", {"spec": {"unschedulable": True}})  # someone else's cordon, before rankwatch
    remediate(api, suspect(job, "gpu-node-0", "gpu-node-1"), policy())
    other = job_on_nodes(api, unwatched_namespace, "gpt", GPU_NODES[2:3], dryRun=True)
    remediate(api, suspect(other, "gpu-node-2"), policy(dryRun=True))
    since = {name: core.read_node(name).metadata.annotations[node_marks.TIME] for name in GPU_NODES[:3]}

    listing = nodes()
    assert listing.returncode == 0, listing.stderr
    header, *rows = listing.stdout.strip().splitlines()
    assert header.split() == ["NODE", "STATE", "JOB", "SINCE", "(UTC)", "AGE", "REASON"]
    by_node = {row.split()[0]: row for row in rows}
    assert set(by_node) == {"gpu-node-0", "gpu-node-1", "gpu-node-2"}, "gpu-node-3 carries no mark"
    assert re.match(rf"gpu-node-0 +cordoned +{unwatched_namespace}/llama +{since['gpu-node-0'][:10]} "
                    rf"{since['gpu-node-0'][11:19]} +\d+[smh] +straggler$", by_node["gpu-node-0"])  # fmt: skip
    assert "cordoned (already before)" in by_node["gpu-node-1"]
    assert re.match(rf"gpu-node-2 +dry-run +{unwatched_namespace}/gpt ", by_node["gpu-node-2"])
    assert "rankwatch uncordon" in listing.stderr, "how to undo"

    as_json = nodes("-o", "json", "--job", f"{unwatched_namespace}/llama")
    found = {entry["node"]: entry for entry in yaml.safe_load(as_json.stdout)}
    assert set(found) == {"gpu-node-0", "gpu-node-1"}
    assert found["gpu-node-0"]["since"] == since["gpu-node-0"] and found["gpu-node-0"]["jobUid"] == job.job_uid
    assert found["gpu-node-0"]["tainted"] and found["gpu-node-0"]["unschedulable"]

    assert uncordon(api, "gpu-node-0").undone
    assert nodes("--job", f"{unwatched_namespace}/llama").stdout.count("gpu-node-") == 1
    bad = nodes("--job", "llama")
    assert bad.returncode == 2 and "expected NAMESPACE/NAME" in bad.stderr


def test_uncordon_annotation_makes_the_operator_undo_the_cordon(
    api, core, namespace, unwatched_namespace, eventually, clean_nodes
):
    # The session operator watches nodes cluster-wide, once a namespace it serves exists (kopf
    # pairs every resource with the served namespaces); the job lives where it makes no pods.
    job = job_on_nodes(api, unwatched_namespace, "llama", GPU_NODES[:2])
    assert remediate(api, suspect(job, "gpu-node-1"), policy()).cordoned == ("gpu-node-1",)

    core.patch_node("gpu-node-1", {"metadata": {"annotations": {"rankwatch.io/uncordon": "true"}}})

    node = eventually(
        lambda: (n := core.read_node("gpu-node-1")) and is_untouched(n) and n,
        30,
        what="the operator to undo the cordon",
    )
    assert "rankwatch.io/uncordon" not in (node.metadata.annotations or {})
    [event] = node_events(core, "gpu-node-1", "UncordonedByRankwatch")
    assert event.message.endswith("(via annotation)")


# ---- RBAC -------------------------------------------------------------------------------------


def _restricted_client(api, kubectl, kubeconfig: str, namespace: str) -> tuple[kubernetes.client.ApiClient, str]:
    """deploy/rbac.yaml applied with its ServiceAccount moved into ``namespace``; a client with that SA's token."""
    docs = list(yaml.safe_load_all((REPO / "deploy" / "rbac.yaml").read_text()))
    binding_name = f"rankwatch-remediation-{namespace}"
    for doc in docs:
        if doc["kind"] == "ServiceAccount":
            doc["metadata"]["namespace"] = namespace
        if doc["kind"] == "ClusterRoleBinding":
            doc["metadata"]["name"] = binding_name
            doc["subjects"][0]["namespace"] = namespace
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    token = (
        kubernetes.client.CoreV1Api(api)
        .create_namespaced_service_account_token("rankwatch-operator", namespace, {"spec": {"expirationSeconds": 600}})
        .status.token
    )
    config = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=config)
    config.cert_file = config.key_file = None
    config.api_key = {"authorization": f"Bearer {token}"}
    return kubernetes.client.ApiClient(config), binding_name


def test_remediation_works_with_only_its_rbac_role_and_nothing_more(
    api, core, kubectl, kubeconfig, unwatched_namespace, eventually, clean_nodes
):
    restricted, binding = _restricted_client(api, kubectl, kubeconfig, unwatched_namespace)
    try:
        as_operator = kubernetes.client.CoreV1Api(restricted)
        eventually(lambda: _allowed(lambda: as_operator.list_node(limit=1)), 30, what="the role binding to apply")
        job = job_on_nodes(api, unwatched_namespace, "llama", GPU_NODES[:2])

        result = remediate(restricted, suspect(job, "gpu-node-1"), policy())
        assert result.cordoned == ("gpu-node-1",)
        assert core.read_node("gpu-node-1").spec.unschedulable is True
        assert node_events(core, "gpu-node-1", "CordonedByRankwatch")
        # A refusal repeated counts up on one Event (events get + patch).
        remediate(restricted, suspect(job, "gpu-node-3"), policy())
        remediate(restricted, suspect(job, "gpu-node-3"), policy())
        [refused] = job_events(core, unwatched_namespace, "llama", "CordonRefused")
        assert refused.count == 2
        assert uncordon(restricted, "gpu-node-1").undone
        assert is_untouched(core.read_node("gpu-node-1"))

        for forbidden in (
            lambda: as_operator.delete_node("gpu-node-2"),
            lambda: as_operator.create_namespaced_pod(
                unwatched_namespace,
                {"metadata": {"name": "x"}, "spec": {"containers": [{"name": "x", "image": "x"}]}},
            ),
            lambda: as_operator.list_namespaced_secret(unwatched_namespace),
            lambda: as_operator.replace_node("gpu-node-2", core.read_node("gpu-node-2")),
        ):
            with pytest.raises(ApiException) as refused_call:
                forbidden()
            assert refused_call.value.status == 403
        assert core.read_node("gpu-node-2").metadata.name == "gpu-node-2"
    finally:
        kubernetes.client.RbacAuthorizationV1Api(api).delete_cluster_role_binding(binding)


def _allowed(call) -> bool:
    try:
        call()
    except ApiException as error:
        if error.status == 403:
            return False
        raise
    return True
