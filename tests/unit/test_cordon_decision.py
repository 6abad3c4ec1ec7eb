"""The safeguards of remediation, decided without a cluster: which named nodes get cordoned and why not the others."""

from __future__ import annotations

import datetime

import pytest

from rankwatch.model.finding import Finding
from rankwatch.operator.config import BreakerSettings, Safeguards
from rankwatch.operator.remediation import circuit_breaker, node_marks
from rankwatch.operator.remediation.cordon_decision import CordonRequest, Outcome, RemediationPolicy, decide
from rankwatch.operator.remediation.node_marks import NodeView
from rankwatch.operator.spec import Remediation

NOW = datetime.datetime(2025, 6, 1, 12, 0, tzinfo=datetime.UTC)
OPEN = Safeguards(breaker=BreakerSettings(max_share=1.0))


def node(name: str, *, labels=None, annotations=None, unschedulable=False, taints=()) -> NodeView:
    return NodeView(name, f"uid-{name}", "1", unschedulable, labels or {}, annotations or {}, tuple(taints))


def cordoned_by(job: str, uid: str, minutes_ago: float = 1, dry_run: bool = False) -> dict[str, str]:
    moment = node_marks.format_time(NOW - datetime.timedelta(minutes=minutes_ago))
    marks = {node_marks.JOB: job, node_marks.JOB_UID: uid, node_marks.TIME: moment, node_marks.REASON: "straggler"}
    marks[node_marks.DRY_RUN if dry_run else node_marks.CORDONED_BY] = "true" if dry_run else "rankwatch"
    return marks


def cluster(count: int, **special: NodeView) -> dict[str, NodeView]:
    nodes = {f"n{i}": node(f"n{i}") for i in range(count)}
    nodes.update(special)
    return nodes


def blame(*nodes: str, confidence: float = 0.9, kind: str = "straggler", diagnosis: str = "",
          job: tuple[str, str, str] = ("team-a", "llama", "uid-1")) -> CordonRequest:  # fmt: skip
    return CordonRequest(*job, Finding(kind, [13], list(nodes), None, confidence, "rank 13 is slow"), diagnosis)


def outcomes(decisions) -> dict[str, Outcome]:
    return {d.node: d.outcome for d in decisions}


def policy(safeguards: Safeguards = OPEN, **job) -> RemediationPolicy:
    return RemediationPolicy(Remediation(**job), safeguards)


def test_straggler_on_one_node_of_the_job_is_cordoned():
    decisions = decide(blame("n1"), policy(), frozenset({"n0", "n1"}), cluster(4), NOW)
    assert outcomes(decisions) == {"n1": Outcome.CORDONED}


def test_node_that_ran_no_pod_of_the_job_is_never_touched():
    decisions = decide(blame("n1", "n3"), policy(), frozenset({"n1"}), cluster(4), NOW)
    assert outcomes(decisions) == {"n1": Outcome.CORDONED, "n3": Outcome.NOT_JOB_NODE}


def test_dry_run_only_annotates_and_counts_against_the_job_limit():
    decisions = decide(blame("n0", "n1", "n2"), policy(dryRun=True), frozenset({"n0", "n1", "n2"}), cluster(4), NOW)
    assert outcomes(decisions) == {"n0": Outcome.DRY_RUN, "n1": Outcome.DRY_RUN, "n2": Outcome.JOB_LIMIT}


def test_cordon_disabled_and_low_confidence_cordon_nothing():
    jobs = frozenset({"n0"})
    assert outcomes(decide(blame("n0"), policy(cordon=False), jobs, cluster(2), NOW)) == {"n0": Outcome.DISABLED}
    guarded = Safeguards(breaker=BreakerSettings(max_share=1.0), min_confidence=0.5)
    decisions = decide(blame("n0", confidence=0.4), policy(guarded), jobs, cluster(2), NOW)
    assert outcomes(decisions) == {"n0": Outcome.LOW_CONFIDENCE}


def test_opted_out_node_is_left_alone():
    nodes = cluster(3, n1=node("n1", labels={"rankwatch.io/remediation": "disabled"}))
    decisions = decide(blame("n1", "n2"), policy(), frozenset({"n1", "n2"}), nodes, NOW)
    assert outcomes(decisions) == {"n1": Outcome.OPTED_OUT, "n2": Outcome.CORDONED}


def test_per_job_limit_counts_nodes_the_job_already_holds():
    nodes = cluster(4, n0=node("n0", annotations=cordoned_by("team-a/llama", "uid-1"), unschedulable=True))
    decisions = decide(blame("n0", "n1", "n2"), policy(maxNodesPerJob=2), frozenset(nodes), nodes, NOW)
    assert outcomes(decisions) == {"n0": Outcome.ALREADY_CORDONED, "n1": Outcome.CORDONED, "n2": Outcome.JOB_LIMIT}


def test_a_recreated_job_of_the_same_name_is_another_job():
    nodes = cluster(2, n0=node("n0", annotations=cordoned_by("team-a/llama", "uid-OLD"), unschedulable=True))
    decisions = decide(blame("n1"), policy(maxNodesPerJob=1), frozenset(nodes), nodes, NOW)
    assert outcomes(decisions) == {"n1": Outcome.CORDONED}


def test_node_cordoned_by_someone_else_is_tainted_and_its_prior_state_kept():
    nodes = cluster(2, n1=node("n1", unschedulable=True))
    decisions = decide(blame("n1"), policy(), frozenset(nodes), nodes, NOW)
    assert outcomes(decisions) == {"n1": Outcome.TAINTED}
    patch = node_marks.mark_patch(
        nodes["n1"],
        job="a/b",
        job_uid="u",
        job_taint_value="a.b",
        reason="hang",
        evidence="",
        moment=NOW,
        dry_run=False,
    )
    assert patch["metadata"]["annotations"][node_marks.WAS_UNSCHEDULABLE] == "true"


def test_recently_uncordoned_node_waits_for_the_cooldown():
    undone = {node_marks.UNCORDONED_AT: node_marks.format_time(NOW - datetime.timedelta(minutes=5))}
    nodes = cluster(2, n1=node("n1", annotations=undone))
    guarded = Safeguards(breaker=BreakerSettings(max_share=1.0), cooldown_seconds=600)
    assert outcomes(decide(blame("n1"), policy(guarded), frozenset(nodes), nodes, NOW)) == {"n1": Outcome.COOLDOWN}
    later = NOW + datetime.timedelta(minutes=6)
    assert outcomes(decide(blame("n1"), policy(guarded), frozenset(nodes), nodes, later)) == {"n1": Outcome.CORDONED}


def test_breaker_caps_cordons_at_the_share_of_nodes_within_the_window():
    guarded = Safeguards(breaker=BreakerSettings(max_share=0.1, window_seconds=600))
    # 30 nodes, cap 3; two cordoned 5 min ago count, one cordoned 20 min ago is outside the window.
    nodes = cluster(
        30,
        n0=node("n0", annotations=cordoned_by("x/a", "ua", 5), unschedulable=True),
        n1=node("n1", annotations=cordoned_by("x/b", "ub", 5), unschedulable=True),
        n2=node("n2", annotations=cordoned_by("x/c", "uc", 20), unschedulable=True),
    )
    decisions = decide(blame("n10", "n11"), policy(guarded), frozenset(nodes), nodes, NOW)
    assert outcomes(decisions) == {"n10": Outcome.CORDONED, "n11": Outcome.BREAKER_OPEN}
    assert "2 of 30 nodes" in decisions[1].message and "cap 3" in decisions[1].message


def test_breaker_ignores_dry_runs_and_small_clusters_may_cordon_one_node():
    settings = BreakerSettings(max_share=0.1, min_nodes=1)
    assert [settings.cap(n) for n in (4, 10, 19, 20, 1000)] == [1, 1, 1, 2, 100]
    nodes = cluster(4, n0=node("n0", annotations=cordoned_by("x/a", "ua", dry_run=True)))
    assert circuit_breaker.state(nodes.values(), settings, NOW).recent == ()


def test_excess_counts_cordons_beyond_the_cap():
    nodes = [
        node(f"n{i}", annotations=cordoned_by("x/a", "ua", minutes_ago=10 - i), unschedulable=True) for i in range(4)
    ]
    breaker = circuit_breaker.state(nodes, BreakerSettings(max_share=0.5, window_seconds=900), NOW)
    assert (breaker.cap, circuit_breaker.excess(breaker), breaker.room) == (2, 2, 0)
    assert breaker.recent == ("n0", "n1", "n2", "n3")


def test_already_cordoned_by_another_job_is_not_cordoned_again():
    nodes = cluster(2, n1=node("n1", annotations=cordoned_by("team-b/gpt", "uid-9"), unschedulable=True))
    decisions = decide(blame("n1"), policy(), frozenset(nodes), nodes, NOW)
    assert outcomes(decisions) == {"n1": Outcome.ALREADY_CORDONED}
    assert "team-b/gpt" in decisions[0].message


def test_a_repeat_of_the_same_diagnosis_finds_its_own_mark_and_finishes_it_but_a_new_one_does_not():
    """The first try wrote the mark and lost the answer: the repeat is the same cordon (its Events are due),
    a later diagnosis of the same job on the same node is nothing new."""
    marks = {**cordoned_by("team-a/llama", "uid-1"), node_marks.DIAGNOSIS: "2026-11-26T19:00:00Z"}
    nodes = cluster(2, n1=node("n1", annotations=marks, unschedulable=True))
    first = blame("n1", diagnosis="2026-11-26T19:00:00Z")
    [repeat] = decide(first, policy(), frozenset(nodes), nodes, NOW)
    assert (repeat.outcome, repeat.resumed, repeat.message) == (Outcome.CORDONED, True, "cordoned and tainted n1")
    later = blame("n1", diagnosis="2026-11-26T19:30:00Z")
    [again] = decide(later, policy(), frozenset(nodes), nodes, NOW)
    assert (again.outcome, again.resumed) == (Outcome.ALREADY_CORDONED, False)
    recreated = blame("n1", diagnosis="2026-11-26T19:00:00Z", job=("team-a", "llama", "uid-2"))
    assert outcomes(decide(recreated, policy(), frozenset(nodes), nodes, NOW)) == {"n1": Outcome.ALREADY_CORDONED}


def test_dry_run_marks_are_upgraded_when_the_job_turns_dry_run_off():
    nodes = cluster(2, n1=node("n1", annotations=cordoned_by("team-a/llama", "uid-1", dry_run=True)))
    dry = decide(blame("n1"), policy(dryRun=True), frozenset(nodes), nodes, NOW)
    real = decide(blame("n1"), policy(), frozenset(nodes), nodes, NOW)
    assert outcomes(dry) == {"n1": Outcome.ALREADY_CORDONED} and outcomes(real) == {"n1": Outcome.CORDONED}


@pytest.mark.parametrize(
    ("namespace", "name", "expected"),
    [
        ("team-a", "llama", "team-a.llama"),
        ("n" * 40, "job-" + "x" * 30, None),  # too long: cut and hashed
    ],
)
def test_taint_value_is_a_valid_label_value_and_tells_namespaces_apart(namespace, name, expected):
    value = node_marks.taint_value(namespace, name)
    assert len(value) <= 63 and node_marks._LABEL_VALUE.match(value)
    if expected:
        assert value == expected
    assert value != node_marks.taint_value(namespace + "b", name)


def test_undo_restores_schedulability_only_when_rankwatch_changed_it():
    taints = (
        {"key": "other", "effect": "NoSchedule"},
        {"key": node_marks.TAINT_KEY, "value": "a.b", "effect": "NoSchedule"},
    )
    ours = node(
        "n1",
        annotations=cordoned_by("a/b", "u") | {node_marks.WAS_UNSCHEDULABLE: "false"},
        unschedulable=True,
        taints=taints,
    )
    patch = node_marks.undo_patch(ours, NOW)
    assert patch["spec"] == {"taints": [{"key": "other", "effect": "NoSchedule"}], "unschedulable": None}
    assert patch["metadata"]["annotations"][node_marks.CORDONED_BY] is None
    assert patch["metadata"]["annotations"][node_marks.UNCORDONED_AT] == node_marks.format_time(NOW)
    before = node(
        "n1",
        annotations=cordoned_by("a/b", "u") | {node_marks.WAS_UNSCHEDULABLE: "true"},
        unschedulable=True,
        taints=taints[1:],
    )
    assert node_marks.undo_patch(before, NOW)["spec"] == {"taints": None}


def test_evidence_annotation_is_bounded():
    text = node_marks.evidence_text("rank 13 slow", {"wait_ms": [0.4] * 1000})
    assert text.startswith("rank 13 slow {") and len(text) == node_marks.EVIDENCE_MAX_CHARS


def test_a_finding_of_an_unknown_kind_is_refused_before_it_reaches_remediation():
    with pytest.raises(ValueError, match=r"'slow' is not a valid FindingKind"):
        blame("n0", kind="slow")


def test_one_namespace_cannot_hold_more_nodes_than_its_cap_however_old_its_cordons():
    """Window after window the breaker has room again; the cap counts every cordon still held."""
    capped = Safeguards(breaker=BreakerSettings(max_share=1.0), max_nodes_per_namespace=2)
    held = {
        f"n{i}": node(f"n{i}", annotations=cordoned_by(f"team-a/old-{i}", f"u{i}", minutes_ago=600)) for i in (0, 1)
    }
    nodes = cluster(10, **held)
    decisions = decide(blame("n2", "n3"), policy(capped), frozenset(nodes), nodes, NOW)
    assert outcomes(decisions) == {"n2": Outcome.NAMESPACE_LIMIT, "n3": Outcome.NAMESPACE_LIMIT}
    assert "namespace team-a" in decisions[0].message
    # Another team's job is not held back by team-a's cordons.
    other = blame("n2", job=("team-b", "gpt", "uid-9"))
    assert outcomes(decide(other, policy(capped), frozenset(nodes), nodes, NOW)) == {"n2": Outcome.CORDONED}


def test_the_cluster_cap_counts_every_namespace_and_cuts_within_one_request():
    capped = Safeguards(breaker=BreakerSettings(max_share=1.0), max_nodes=2)
    nodes = cluster(10, n0=node("n0", annotations=cordoned_by("team-b/gpt", "u0", minutes_ago=600)))
    decisions = decide(blame("n1", "n2"), policy(capped), frozenset(nodes), nodes, NOW)
    assert outcomes(decisions) == {"n1": Outcome.CORDONED, "n2": Outcome.CLUSTER_LIMIT}


def test_dry_run_marks_do_not_count_against_the_caps():
    capped = Safeguards(breaker=BreakerSettings(max_share=1.0), max_nodes=1, max_nodes_per_namespace=1)
    dry = cordoned_by("team-a/old", "u0", dry_run=True)
    nodes = cluster(4, n0=node("n0", annotations=dry))
    assert outcomes(decide(blame("n1"), policy(capped), frozenset(nodes), nodes, NOW)) == {"n1": Outcome.CORDONED}


def test_expiry_is_read_back_and_an_unreadable_one_counts_as_passed():
    marks = cordoned_by("team-a/llama", "uid-1")
    assert node("n0", annotations=marks).mark.expires is None
    later = NOW + datetime.timedelta(hours=1)
    assert node("n0", annotations={**marks, node_marks.EXPIRES: node_marks.format_time(later)}).mark.expires == later
    assert node("n0", annotations={**marks, node_marks.EXPIRES: "soon"}).mark.expires < NOW
    patch = node_marks.mark_patch(
        node("n0"), job="a/b", job_uid="u", job_taint_value="a.b", reason="hang", evidence="", moment=NOW,
        dry_run=False, expires=later,
    )  # fmt: skip
    assert patch["metadata"]["annotations"][node_marks.EXPIRES] == node_marks.format_time(later)
    assert (
        node_marks.undo_patch(node("n0", annotations={**marks, node_marks.EXPIRES: "x"}), NOW)["metadata"][
            "annotations"
        ][node_marks.EXPIRES]
        is None
    )


def test_mismatched_collectives_cordon_no_node_and_page_the_owner():
    """A mismatch is the job's code: its nodes are left alone, whatever the job allows, and the alert
    goes out at the job's mismatch level (P0 by default: its owner is paged)."""
    from rankwatch.alerting.findings import alert_from_finding
    from rankwatch.operator.spec import AlertLevels

    finding = Finding("mismatch", [13], ["n1"], "00ab", 0.95, "rank 13 broadcasts where its peers all-reduce",
                      cause="software")  # fmt: skip
    request = CordonRequest("team-a", "llama", "uid-1", finding)
    for job in ({}, {"dryRun": True}, {"maxNodesPerJob": 8}):
        assert outcomes(decide(request, policy(**job), frozenset({"n0", "n1"}), cluster(4), NOW)) == {
            "n1": Outcome.SOFTWARE_FAULT
        }
    assert not Outcome.SOFTWARE_FAULT.changes_node
    alert = alert_from_finding("team-a", "llama", finding)
    assert alert.labels["alertname"] == "TrainingJobCollectiveMismatch" and alert.level.name == "P0"
    assert alert.annotations["cause"].startswith("cause software")
    quieter = alert_from_finding("team-a", "llama", finding, level=AlertLevels(mismatch="P2").for_finding(finding.kind))
    assert quieter.level.name == "P2"
