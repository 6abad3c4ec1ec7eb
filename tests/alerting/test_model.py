"""Alerts, matchers, routes and findings: identity, Alertmanager's routing semantics, levels per job."""

from __future__ import annotations

import json

import pytest
import yaml
from alerting_support import config_data, job_alert, merge, secrets_for

from rankwatch.alerting import alert_from_finding, load_config
from rankwatch.alerting.config import InhibitRule
from rankwatch.alerting.inhibition import inhibited_by
from rankwatch.alerting.matchers import Matcher, MatcherError
from rankwatch.alerting.model import Alert, Level, fingerprint
from rankwatch.alerting.routing import group_keys, matching_routes
from rankwatch.model.finding import Finding
from rankwatch.operator.spec import AlertLevels


def test_fingerprint_is_the_label_set_in_any_order_and_nothing_else():
    a = {"alertname": "NodeDown", "node": "gpu-node-1"}
    b = {"node": "gpu-node-1", "alertname": "NodeDown"}
    assert fingerprint(a) == fingerprint(b) == "5296cc8f5f6a765c"  # pinned: stored state depends on it
    assert Alert(a, Level.P0, 1.0).fingerprint == Alert(b, Level.P3, 2.0, {"summary": "x"}).fingerprint
    assert fingerprint({**a, "node": "gpu-node-2"}) != fingerprint(a)


@pytest.mark.parametrize(
    ("text", "labels", "hit"),
    [
        ('level="P0"', {"level": "P0"}, True),
        ("level=P0", {"level": "P1"}, False),
        ('node!="gpu-node-1"', {}, True),
        ('level=~"P1|P2"', {"level": "P2"}, True),
        ('level=~"P1"', {"level": "P10"}, False),  # anchored, as in Alertmanager
        ('trainingjob!~".+"', {}, True),
        ('summary="a \\"quoted\\" word"', {"summary": 'a "quoted" word'}, True),
    ],
)
def test_matchers(text, labels, hit):
    assert Matcher.parse(text).matches(labels) is hit


def test_matcher_errors_say_what_to_write():
    with pytest.raises(MatcherError, match=r'write name="value"'):
        Matcher.parse("level")


def test_routes_follow_alertmanager_first_match_and_continue(feishu):
    config = load_config(yaml.safe_dump(config_data(feishu, "/tmp/x.sqlite")), secrets_for(feishu))
    p0 = job_alert(level=Level.P0).match_labels()
    assert [r.receiver for r in matching_routes(config.route, p0)] == ["oncall-phone", "team"]
    assert [r.receiver for r in matching_routes(config.route, {"level": "P1", "team": "ops"})] == ["ops-hook"]
    assert [r.receiver for r in matching_routes(config.route, {"level": "P1"})] == ["team"]


def test_group_keys_come_from_group_by_and_every_label_with_dots(feishu):
    data = merge(config_data(feishu, "/tmp/x.sqlite"), {"route": {"group_by": ["..."], "routes": []}})
    config = load_config(yaml.safe_dump(data), secrets_for(feishu))
    (key,) = group_keys(config.route, job_alert())
    assert dict(key.labels) == dict(job_alert().labels)
    (other,) = group_keys(config.route, job_alert(node="gpu-node-2"))
    assert key.key != other.key and key.key.startswith("route:")


def test_inhibition_needs_a_firing_source_agreeing_on_the_equal_labels():
    rule = InhibitRule((Matcher.parse('alertname="NodeDown"'),), (Matcher.parse('level="P1"'),), ("node",))
    down = Alert({"alertname": "NodeDown", "node": "n1"}, Level.P1, 0.0)
    assert inhibited_by(job_alert(node="n1"), [rule], [down], now=10.0) is not None
    assert inhibited_by(job_alert(node="n2"), [rule], [down], now=10.0) is None
    assert inhibited_by(job_alert(node="n1"), [rule], [down.resolve(5.0)], now=10.0) is None
    assert inhibited_by(down, [rule], [down], now=10.0) is None  # never itself


FINDING = Finding(
    kind="straggler",
    ranks=[13],
    nodes=["gpu-node-1"],
    communicator="00000000deadbeef",
    confidence=0.93,
    summary="rank 13 (gpu-node-1) arrives last in 97% of TP all-reduces",
    evidence={"robust_z": 8.1, "wait_ms_p50": {"13": 0.2, "peers": 41.0}},
)


def test_a_finding_becomes_an_alert_levelled_by_the_jobs_spec():
    alert = alert_from_finding("ml", "llama-70b", FINDING, "llm", AlertLevels(straggler="P0").for_finding(FINDING.kind))
    assert alert.level == Level.P0
    assert alert.labels == {
        "alertname": "TrainingJobStraggler",
        "kind": "straggler",
        "namespace": "ml",
        "trainingjob": "llama-70b",
        "route": "llm",
        "node": "gpu-node-1",
        "rank": "13",
        "communicator": "00000000deadbeef",
    }
    assert json.loads(alert.annotations["evidence"])["robust_z"] == 8.1
    assert alert.annotations["confidence"] == "0.93"


def test_the_same_culprit_found_again_is_the_same_alert_and_defaults_follow_the_crd():
    again = Finding(**{**FINDING.__dict__, "confidence": 0.71, "evidence": {"robust_z": 6.0}})
    assert alert_from_finding("ml", "j", FINDING).fingerprint == alert_from_finding("ml", "j", again).fingerprint
    levels = {
        kind: alert_from_finding("ml", "j", Finding(**{**FINDING.__dict__, "kind": kind})).level
        for kind in ("hang", "straggler", "slow_link", "fail_slow")
    }
    assert levels == {"hang": Level.P0, "straggler": Level.P1, "slow_link": Level.P1, "fail_slow": Level.P2}


def test_a_hang_with_thousands_of_ranks_keeps_a_short_label():
    hang = Finding("hang", list(range(4096)), ["gpu-node-1"], None, 0.9, "stuck")
    assert alert_from_finding("ml", "j", hang).labels["rank"].endswith(",15,+4080")
