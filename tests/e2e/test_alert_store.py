"""The alert store in the API server (ConfigMaps), as both operator replicas reach it: what one replica
stored, the next one reads; a failover neither repeats a page nor loses one; a stale writer is refused."""

from __future__ import annotations

import asyncio
import json
import random
import string
import time
from dataclasses import replace

import pytest
import yaml
from alerting_support import BOT_TOKEN, SIGNING_SECRET, config_data, job_alert, merge, secrets_for, wait_for
from fake_feishu import FakeFeishu

from rankwatch.alerting import AlertPipeline, Level, alert_from_finding, load_config
from rankwatch.alerting.cluster_store import ClusterAlertStore, week_start
from rankwatch.alerting.matchers import Matcher
from rankwatch.alerting.report import weekly_report
from rankwatch.alerting.silences import Silence
from rankwatch.alerting.store import NotifyRecord, StoreError
from rankwatch.model.finding import Finding

pytestmark = pytest.mark.e2e

WEEK = 7 * 86400


def test_what_one_replica_stores_the_next_one_reads(api, unwatched_namespace):
    now = time.time()
    first = ClusterAlertStore(api, unwatched_namespace, "alerts")
    alert = job_alert(level=Level.P0, name="TrainingJobHang")
    first.save_alerts([alert], now)
    first.record_notified([NotifyRecord("group-1", "team", frozenset({alert.fingerprint}), frozenset(), now)])
    first.set_meta("report_slot", "123.0")
    first.save_silence(Silence.new([Matcher.parse('node="gpu-node-17"')], now, now + 3600, "ops", "HBM"))
    first.save_silence(Silence.new([Matcher.parse('node="gpu-node-3"')], now - 10, now - 1, "ops", "over"))

    second = ClusterAlertStore(api, unwatched_namespace, "alerts")  # the standby, after a failover
    assert [a.fingerprint for a in second.load_alerts()] == [alert.fingerprint]
    assert second.load_notify_log()[("group-1", "team")].firing == {alert.fingerprint}
    assert second.get_meta("report_slot") == "123.0"
    assert [s.comment for s in second.load_silences(now)] == ["HBM"]  # the expired one is dropped

    later = now + 600
    second.save_alerts([alert.resolve(later)], later)
    episodes = second.episodes(now - 60, later + 60)
    assert [(e.alertname, e.ends_at) for e in episodes] == [("TrainingJobHang", later)]
    assert weekly_report(second, "team", later + 60).total == 1


def test_a_stale_replica_is_refused_instead_of_overwriting(api, unwatched_namespace):
    leader = ClusterAlertStore(api, unwatched_namespace, "alerts")
    leader.set_meta("k", "1")
    old = ClusterAlertStore(api, unwatched_namespace, "alerts")  # read, then the leader moved on
    leader.set_meta("k", "2")
    with pytest.raises(StoreError, match="changed by someone else"):
        old.set_meta("k", "stale")
    assert ClusterAlertStore(api, unwatched_namespace, "alerts").get_meta("k") == "2"


def test_old_weeks_of_history_are_pruned(api, unwatched_namespace):
    store = ClusterAlertStore(api, unwatched_namespace, "alerts")
    now = time.time()
    old_start = now - 20 * WEEK
    alert = replace(job_alert(level=Level.P1), starts_at=old_start)
    store.save_alerts([alert], old_start)
    store.save_alerts([alert.resolve(old_start + 60)], now)
    assert len(store.episodes(old_start - 1, old_start + 1)) == 1
    assert store.prune(now - 10 * WEEK) == 1
    assert store.episodes(old_start - 1, old_start + 1) == []
    assert week_start(now).weekday() == 0


async def test_a_new_leader_on_the_same_store_pages_nothing_twice_and_resolves_once(api, unwatched_namespace):
    feishu = FakeFeishu()
    await feishu.start()
    feishu.add_bot(BOT_TOKEN, SIGNING_SECRET)
    try:
        data = merge(config_data(feishu, ""), {"store": {"configMap": "alerts"}})
        del data["store"]["path"]
        config = load_config(yaml.safe_dump(data), secrets_for(feishu))
        alert = job_alert(level=Level.P1, name="TrainingJobStraggler")

        leader = AlertPipeline(config, store=ClusterAlertStore(api, unwatched_namespace, "alerts"))
        await leader.start()
        await leader.submit([alert])
        await wait_for(lambda: len(feishu.cards()) == 1, what="the page")
        await leader.wait_idle()
        # The leader dies without stopping (SIGKILL): nothing of it runs on; a standby takes over.
        leader._loop_task.cancel()  # type: ignore[union-attr]

        standby = AlertPipeline(config, store=ClusterAlertStore(api, unwatched_namespace, "alerts"))
        await standby.start()
        try:
            await standby.submit([alert])  # the finding is reported again after the failover
            await asyncio.sleep(1.0)
            assert len(feishu.cards()) == 1, "no second page"
            await standby.resolve(labels={"trainingjob": alert.labels["trainingjob"]})
            await wait_for(lambda: len(feishu.cards()) == 2, what="the resolved notice")
            await asyncio.sleep(0.5)
            assert len(feishu.cards()) == 2
        finally:
            await standby.stop(grace=0.5)
            await leader.stop(grace=0)  # only its HTTP session is left to close
    finally:
        await feishu.stop()


def _hostile_finding(rng: random.Random, job: int) -> Finding:
    """A straggler whose frames and profile name functions of 40 KB (that do not compress)."""

    def name() -> str:
        return "".join(rng.choices(string.ascii_letters + string.digits, k=40_000))

    evidence = {
        "culprit_frame": {"file": "train.py", "line": 3, "function": name()},
        "waiting_frame": {"file": "train.py", "line": 9, "function": name()},
        "python_profile": {"differences": [{"function": name(), "culprit_share": 0.9} for _ in range(8)]},
    }
    return Finding("straggler", [job], [f"gpu-node-{job}"], None, 0.9, f"rank {job} is slow in {name()}", evidence)


async def test_one_teams_huge_frame_texts_neither_fill_the_store_nor_block_another_teams_page(api, unwatched_namespace):
    feishu = FakeFeishu()
    await feishu.start()
    feishu.add_bot(BOT_TOKEN, SIGNING_SECRET)
    try:
        data = merge(config_data(feishu, ""), {"store": {"configMap": "alerts"}})
        del data["store"]["path"]
        config = load_config(yaml.safe_dump(data), secrets_for(feishu))
        pipeline = AlertPipeline(config, store=ClusterAlertStore(api, unwatched_namespace, "alerts"))
        await pipeline.start()
        try:
            rng = random.Random(27)
            for job in range(3):
                await pipeline.submit([alert_from_finding("team-a", f"job-{job}", _hostile_finding(rng, job))])
            other = job_alert(job="small", level=Level.P1)
            await pipeline.submit([other])  # another team's alert: stored, then paged
            await wait_for(lambda: any("small" in json.dumps(card) for card in feishu.cards()), what="team b's page")
        finally:
            await pipeline.stop(grace=0.5)
        stored = ClusterAlertStore(api, unwatched_namespace, "alerts").load_alerts()
        assert other.fingerprint in {alert.fingerprint for alert in stored}
        assert max(len(json.dumps(alert.to_json())) for alert in stored) < 16_000
    finally:
        await feishu.stop()


def test_a_write_the_store_refuses_leaves_it_as_it_was_for_the_next_one(api, unwatched_namespace):
    store = ClusterAlertStore(api, unwatched_namespace, "alerts")
    rng = random.Random(3)
    huge = job_alert(job="huge", evidence="".join(rng.choices(string.ascii_letters, k=1_500_000)))
    with pytest.raises(StoreError, match="over the 900 KiB an object may hold"):
        store.save_alerts([huge], time.time())
    small = job_alert(job="small")
    store.save_alerts([small], time.time())  # not refused for the one before it
    assert [a.fingerprint for a in store.load_alerts()] == [small.fingerprint]
    reread = ClusterAlertStore(api, unwatched_namespace, "alerts")
    assert [a.fingerprint for a in reread.load_alerts()] == [small.fingerprint]
