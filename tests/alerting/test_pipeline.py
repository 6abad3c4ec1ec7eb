"""The pipeline end to end against the local Feishu: dedup, repeat, resolve, inhibition, silences, storms."""

from __future__ import annotations

import asyncio
import time

from alerting_support import USERS, SkewedClock, job_alert, metric, wait_for

from rankwatch.alerting.model import Alert, Level


def titles(feishu) -> list[str]:
    return [card["header"]["title"]["content"] for card in feishu.cards()]


async def test_duplicates_are_suppressed_and_repeated_at_repeat_interval(feishu, pipelines):
    # The repeat comes when the test moves the clock past repeat_interval, not when a loaded machine
    # happens to get there.
    clock = SkewedClock()
    pipeline = await pipelines({"route": {"repeat_interval": "60s"}}, clock=clock)
    alert = job_alert()
    await pipeline.submit([alert])
    await wait_for(lambda: len(feishu.cards()) == 1, what="the first card")
    for _ in range(5):  # the diagnosis finds the same straggler again and again
        clock.advance(5)
        await pipeline.submit([job_alert()])
    await asyncio.sleep(0.3)  # a few of the pipeline's evaluation ticks: nothing more is sent
    assert len(feishu.cards()) == 1
    clock.advance(60)
    await wait_for(lambda: len(feishu.cards()) == 2, what="the repeat")
    assert "still firing (repeat)" in str(feishu.cards()[1])
    assert metric(pipelines.registry, "rankwatch_alerts_suppressed_total", level="P1", reason="duplicate") == 5
    assert metric(pipelines.registry, "rankwatch_alerts_sent_total", level="P1", receiver="team") == 2
    assert metric(pipelines.registry, "rankwatch_alerts_received_total", level="P1", source="rankwatch") == 6


async def test_resolving_sends_one_green_notice_and_forgets_the_alert(feishu, pipelines):
    pipeline = await pipelines()
    await pipeline.submit([job_alert(level=Level.P2)])
    await wait_for(lambda: len(feishu.cards()) == 1)
    assert await pipeline.resolve(labels={"namespace": "ml", "trainingjob": "llama-70b"}) == 1
    await wait_for(lambda: len(feishu.cards()) == 2, what="the resolved notice")
    assert feishu.cards()[1]["header"]["template"] == "green"
    await asyncio.sleep(0.4)
    assert len(feishu.cards()) == 2 and pipeline.active_alerts() == []
    # The same condition later is a new firing: notified again.
    await pipeline.submit([job_alert(level=Level.P2)])
    await wait_for(lambda: len(feishu.cards()) == 3)


async def test_an_alert_resolved_before_anyone_was_told_is_never_notified(feishu, pipelines):
    pipeline = await pipelines({"route": {"group_wait": "300ms"}})
    alert = job_alert()
    await pipeline.submit([alert])
    await pipeline.submit([alert.resolve(time.time())])
    await asyncio.sleep(0.5)
    assert feishu.cards() == [] and pipeline.active_alerts() == []


async def test_alerts_of_one_group_arrive_as_one_card(feishu, pipelines):
    pipeline = await pipelines({"route": {"group_by": ["alertname", "namespace", "trainingjob"]}})
    await pipeline.submit([job_alert(node=f"gpu-node-{i}") for i in range(3)])
    await wait_for(lambda: feishu.cards())
    await asyncio.sleep(0.2)
    assert titles(feishu) == ["[P1] TrainingJobStraggler · ml/llama-70b (+2 more)"]


async def test_p0_rings_every_recipient_and_posts_the_card(feishu, pipelines):
    pipeline = await pipelines()
    await pipeline.submit([job_alert(level=Level.P0, name="TrainingJobHang")])
    await wait_for(lambda: len(feishu.calls) == len(USERS), what="a call to every user")
    await wait_for(lambda: feishu.cards(), what="the group card")
    assert sorted(user for _, user in feishu.calls) == sorted(USERS)
    assert len({message_id for message_id, _ in feishu.calls}) == len(USERS)  # each user's own message
    assert titles(feishu) == ["[P0] TrainingJobHang · ml/llama-70b"]
    assert feishu.count("token") == 1
    # P1 does not ring.
    await pipeline.submit([job_alert(level=Level.P1, node="gpu-node-2")])
    await wait_for(lambda: len(feishu.cards()) == 2)
    await asyncio.sleep(0.1)
    assert len(feishu.calls) == len(USERS)


async def test_a_node_down_inhibits_the_job_alerts_on_that_node_only(feishu, pipelines):
    pipeline = await pipelines()
    node_down = Alert(
        labels={"alertname": "NodeDown", "node": "gpu-node-1", "severity": "P1"},
        level=Level.P1,
        starts_at=time.time(),
        annotations={"summary": "gpu-node-1 is NotReady"},
        source="alertmanager",
    )
    await pipeline.submit([node_down, job_alert(node="gpu-node-1"), job_alert(node="gpu-node-2")])
    await wait_for(lambda: len(feishu.cards()) == 2)
    await asyncio.sleep(0.3)
    assert sorted(titles(feishu)) == ["[P1] NodeDown · gpu-node-1", "[P1] TrainingJobStraggler · ml/llama-70b"]
    assert (
        "gpu-node-2" in str(feishu.cards())
        and metric(pipelines.registry, "rankwatch_alerts_suppressed_total", level="P1", reason="inhibited") == 1
    )
    # The node comes back: the job alert on it is no longer muted, and is told.
    await pipeline.resolve([node_down.fingerprint])
    await wait_for(lambda: len(feishu.cards()) == 4, what="the resolved node and the uninhibited job alert")
    assert "[Resolved] [P1] NodeDown · gpu-node-1" in titles(feishu)


async def test_silences_mute_until_they_expire(feishu, pipelines):
    pipeline = await pipelines()
    silence = pipeline.add_silence(['trainingjob="llama-70b"'], time.time() + 0.6, "alice", "maintenance")
    await pipeline.submit([job_alert(), job_alert(job="gpt-13b")])
    await wait_for(lambda: feishu.cards())
    await asyncio.sleep(0.3)
    assert titles(feishu) == ["[P1] TrainingJobStraggler · ml/gpt-13b"]
    assert [s.id for s in pipeline.silences()] == [silence.id]
    await wait_for(lambda: len(feishu.cards()) == 2, what="the alert once the silence expired")
    assert titles(feishu)[1] == "[P1] TrainingJobStraggler · ml/llama-70b"
    assert pipeline.silences() == []
    assert metric(pipelines.registry, "rankwatch_alerts_suppressed_total", level="P1", reason="silenced") == 1


async def test_a_silence_from_the_config_applies_and_a_runtime_one_can_be_expired(feishu, pipelines):
    pipeline = await pipelines({"silences": [{"matchers": ['level="P3"'], "ends_at": "2099-01-01T00:00:00Z"}]})
    runtime = pipeline.add_silence(['node="gpu-node-2"'], time.time() + 3600)
    await pipeline.submit([job_alert(level=Level.P3), job_alert(node="gpu-node-2")])
    await asyncio.sleep(0.3)
    assert feishu.cards() == []
    assert pipeline.expire_silence(runtime.id)
    await wait_for(lambda: len(feishu.cards()) == 1)
    assert "gpu-node-2" in str(feishu.cards()[0])


async def test_a_storm_of_500_alerts_yields_one_summary(feishu, pipelines):
    # The window ends when the test moves the clock, not when a loaded machine's flush of the 500
    # notifications happens to outlast it (a second window would rightly admit 10 more).
    clock = SkewedClock()
    pipeline = await pipelines(
        {"storm": {"max_alerts": 10, "window": "60s"}, "route": {"group_interval": "5s"}}, clock=clock
    )
    storm = [
        Alert(
            labels={"alertname": "GPUXidError", "node": f"gpu-node-{i}", "severity": "P2"},
            level=Level.P2,
            starts_at=clock(),
            annotations={"summary": f"XID 79 on gpu-node-{i}"},
        )
        for i in range(500)
    ]
    await pipeline.submit(storm)
    registry = pipelines.registry
    await wait_for(lambda: len(feishu.cards()) == 10, timeout=60, what="10 cards")
    await wait_for(lambda: metric(registry, "rankwatch_alerts_suppressed_total", level="P2", reason="storm") == 490,
                   timeout=60, what="the other 490 held")  # fmt: skip
    assert len(feishu.cards()) == 10, "nothing more inside the window"
    clock.advance(60)  # the window ends: one summary
    await wait_for(lambda: len(feishu.cards()) == 11, timeout=60, what="the summary")
    clock.advance(60)  # another window: nothing more
    await asyncio.sleep(1.0)
    cards = feishu.cards()
    assert len(cards) == 11
    assert all(card["header"]["title"]["content"].startswith("[P2] GPUXidError · gpu-node-") for card in cards[:10])
    summary = cards[10]
    assert summary["header"]["title"]["content"].startswith("[P2] Alert storm: 490 firing, 0 resolved")
    assert summary["header"]["template"] == "yellow"
    assert "GPUXidError: 490" in str(summary)
    assert metric(registry, "rankwatch_alerts_suppressed_total", level="P2", reason="storm") == 490
    assert metric(registry, "rankwatch_alerts_sent_total", level="P2", receiver="team") == 500


async def test_a_restart_loses_nothing_and_repages_nothing(feishu, pipelines):
    first = await pipelines()
    told = job_alert(level=Level.P0, name="TrainingJobHang")
    await first.submit([told])
    await wait_for(lambda: len(feishu.calls) == 3 and len(feishu.cards()) == 1, what="the P0 page")
    silence = first.add_silence(['trainingjob="silenced-job"'], time.time() + 3600)
    # Submitted but still in group_wait when the operator stops: nobody was told yet.
    await first.stop()
    untold = job_alert(node="gpu-node-7")
    assert not untold.resolved(time.time())
    stopped = await pipelines({"route": {"group_wait": "1h"}})
    await stopped.submit([untold, job_alert(job="silenced-job")])
    await stopped.stop()

    second = await pipelines()
    await wait_for(lambda: len(feishu.cards()) == 2, what="the alert submitted before the restart")
    await asyncio.sleep(0.4)
    assert titles(feishu)[1] == "[P1] TrainingJobStraggler · ml/llama-70b"
    assert "gpu-node-7" in str(feishu.cards()[1])
    assert len(feishu.calls) == 3 and len(feishu.cards()) == 2  # the P0 was not paged again
    assert [s.id for s in second.silences()] == [silence.id]
    # The restored state still knows what it told: resolving the P0 sends its resolved notice.
    await second.resolve([told.fingerprint])
    await wait_for(lambda: len(feishu.cards()) == 3)
    assert feishu.cards()[2]["header"]["template"] == "green"
    assert len(feishu.calls) == 3  # a resolved notice does not ring


async def test_a_failed_delivery_is_tried_again_at_the_next_group_interval(feishu, pipelines):
    pipeline = await pipelines({"delivery": {"attempts": 1}})
    feishu.fail("bot", status=500)
    await pipeline.submit([job_alert()])
    await wait_for(lambda: len(feishu.cards()) == 1, what="the card after the failure")
    assert feishu.count("bot") == 2
    assert (
        metric(pipelines.registry, "rankwatch_alerts_failed_total", level="P1", receiver="team", reason="server_error")
        == 1
    )


async def test_routes_send_ops_alerts_to_the_webhook_in_alertmanager_format(feishu, pipelines):
    pipeline = await pipelines()
    alert = Alert(labels={"alertname": "DiskFull", "team": "ops"}, level=Level.P2, starts_at=time.time())
    await pipeline.submit([alert])
    await wait_for(lambda: feishu.webhooks("ops"))
    (payload,) = feishu.webhooks("ops")
    assert payload["version"] == "4" and payload["status"] == "firing" and payload["receiver"] == "ops-hook"
    assert payload["alerts"][0]["labels"] == {"alertname": "DiskFull", "team": "ops", "level": "P2"}
    assert payload["alerts"][0]["fingerprint"] == alert.fingerprint
    assert feishu.cards() == []
