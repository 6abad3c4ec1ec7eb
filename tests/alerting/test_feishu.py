"""Feishu custom bot: signed cards with the right colour and content; Feishu's errors handled as documented."""

from __future__ import annotations

import html
import json
import logging
import time

import aiohttp
import pytest
from alerting_support import BOT_TOKEN, SECRET_VALUES, SIGNING_SECRET, job_alert, metric, secrets_for, wait_for

from rankwatch.alerting.config import DeliveryConfig, FeishuBot
from rankwatch.alerting.delivery import DeliveryError, deliver
from rankwatch.alerting.feishu import FeishuBotReceiver, sign
from rankwatch.alerting.messages import Notification
from rankwatch.alerting.model import Alert, Level
from rankwatch.alerting.secrets import Secret

FAST = DeliveryConfig(timeout=0.5, attempts=3, backoff=0.01, max_backoff=0.05)


def texts(card: dict) -> str:
    return json.dumps(card, ensure_ascii=False)


def shown(card: dict) -> str:
    """The card's text as Feishu shows it (character references decoded)."""
    return html.unescape(texts(card))


def bot(feishu, secret: str | None = SIGNING_SECRET, mentions: tuple[str, ...] = ()) -> FeishuBotReceiver:
    return FeishuBotReceiver(
        "team",
        FeishuBot(
            webhook_url=Secret(feishu.bot_url(BOT_TOKEN), "feishu-bot/webhook-url"),
            secret=Secret(secret, "feishu-bot/signing-secret") if secret else None,
            mentions=mentions,
        ),
    )


def notification(*alerts: Alert, resolved: tuple[Alert, ...] = ()) -> Notification:
    return Notification("team", "route:abc", {"alertname": "x"}, tuple(alerts), resolved)


def test_signature_is_base64_hmac_sha256_keyed_by_timestamp_and_secret():
    # Feishu's documented example: the key is "<timestamp>\n<secret>", the message empty.
    import base64
    import hashlib
    import hmac

    expected = base64.b64encode(hmac.new(b"1599360473\ndemo", b"", hashlib.sha256).digest()).decode()
    assert sign("1599360473", "demo") == expected


@pytest.mark.parametrize(
    ("level", "colour"), [(Level.P0, "red"), (Level.P1, "orange"), (Level.P2, "yellow"), (Level.P3, "blue")]
)
async def test_card_header_colour_follows_the_level(feishu, level, colour):
    async with aiohttp.ClientSession() as session:
        await deliver(bot(feishu), notification(job_alert(level=level)), session, FAST)
    (card,) = feishu.cards()
    assert card["header"]["template"] == colour
    assert card["header"]["title"]["content"].startswith(f"[{level}] TrainingJobStraggler · ml/llama-70b")


async def test_resolved_card_is_green_and_says_when_it_resolved(feishu):
    alert = job_alert(level=Level.P0)
    alert = alert.resolve(alert.starts_at + 125)
    async with aiohttp.ClientSession() as session:
        await deliver(bot(feishu), notification(resolved=(alert,)), session, FAST)
    (card,) = feishu.cards()
    assert card["header"]["template"] == "green"
    assert card["header"]["title"]["content"].startswith("[Resolved] [P0] TrainingJobStraggler")
    assert "**Resolved**" in texts(card) and "after 2m05s" in texts(card)


async def test_card_shows_job_node_rank_summary_evidence_time_and_mentions(feishu):
    alert = job_alert(
        level=Level.P0,
        name="TrainingJobHang",
        evidence=json.dumps({"last_seq": 41, "peers_at": 42, "waited_seconds": 312.5}),
    )
    async with aiohttp.ClientSession() as session:
        await deliver(bot(feishu, mentions=("u-alice", "all")), notification(alert), session, FAST)
    (card,) = feishu.cards()
    fields = {
        f["text"]["content"].split("\n")[0]: f["text"]["content"].split("\n")[1] for f in card["elements"][0]["fields"]
    }
    assert fields == {"**Job**": "ml/llama-70b", "**Node**": "gpu-node-1", "**Rank**": "13", "**Level**": "P0"}
    body = shown(card)
    assert "rank 13 on gpu-node-1 is slow" in body
    assert "last_seq: 41" in body and "waited_seconds: 312.5" in body
    assert "**Started** " + time.strftime("%Y-%m-%dT", time.gmtime(alert.starts_at)) in body
    assert '<at user_id=\\"u-alice\\"></at> <at id=all></at>' in body


async def test_card_of_a_finding_shows_its_cause_with_the_figures(feishu):
    from rankwatch.alerting import alert_from_finding
    from rankwatch.model.finding import Finding

    finding = Finding(
        "straggler", [13], ["gpu-node-1"], None, 0.9, "rank 13 arrives last", {"delay_ms": 2.1}, "host",
        "rank 13's process waited 310 ms per second for a CPU against a median 4 ms/s of its 7 peers",
    )  # fmt: skip
    alert = alert_from_finding("ml", "llama-70b", finding)
    assert alert.annotations["cause"].startswith("cause host: rank 13's process waited 310 ms")
    async with aiohttp.ClientSession() as session:
        await deliver(bot(feishu), notification(alert), session, FAST)
    (card,) = feishu.cards()
    assert "**Cause**\\ncause host: rank 13's process waited 310 ms per second for a CPU" in texts(card)


async def test_a_jobs_function_name_is_shown_as_text_never_as_markup_a_link_or_a_mention(feishu):
    from rankwatch.alerting import alert_from_finding
    from rankwatch.model.finding import Finding

    hostile = "**URGENT: drain every node** [open the runbook](https://evil.example/run) <at id=all></at> ~~ok~~"
    frame = {"file": "train.py", "line": 7, "function": hostile}
    finding = Finding("straggler", [13], ["gpu-node-1"], None, 0.9, f"rank 13 is slow in {hostile}",
                      {"culprit_frame": frame}, "unknown", f"its call at train.py:7 in {hostile}")  # fmt: skip
    async with aiohttp.ClientSession() as session:
        await deliver(bot(feishu), notification(alert_from_finding("ml", "llama-70b", finding)), session, FAST)
    (card,) = feishu.cards()
    markdown = [
        text["content"]
        for element in card["elements"]
        for text in [element.get("text") or {}] + [f["text"] for f in element.get("fields") or []]
        if text.get("tag") == "lark_md"
    ]
    tenant = [content for content in markdown if "URGENT" in content]
    assert len(tenant) == 3  # summary, cause, evidence
    for content in tenant:
        for markup in ("**URGENT", "](", "https://", "<at", "~~"):
            assert markup not in content, content
    assert hostile in shown(card)  # the person paged still reads the name as the job spelled it


async def test_a_card_of_many_alerts_stays_under_feishus_20_kb_limit(feishu):
    alerts = [job_alert(node=f"gpu-node-{i}", evidence=json.dumps({"x" * 50: "y" * 900})) for i in range(200)]
    async with aiohttp.ClientSession() as session:
        await deliver(bot(feishu), notification(*alerts), session, FAST)
    (card,) = feishu.cards()
    assert len(json.dumps(card, ensure_ascii=False).encode()) < 20_000
    assert "… and 190 more" in texts(card)


async def test_a_card_of_markup_heavy_alerts_stays_under_feishus_20_kb_limit(feishu):
    alerts = [job_alert(node=f"gpu-node-{i}", evidence="<" * 900) for i in range(10)]
    async with aiohttp.ClientSession() as session:
        await deliver(bot(feishu), notification(*alerts), session, FAST)
    (card,) = feishu.cards()
    assert len(json.dumps(card, ensure_ascii=False).encode()) < 20_000


async def test_a_wrong_signing_secret_is_a_clear_error_without_a_retry_storm(feishu, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = "not-the-s3cret"
    async with aiohttp.ClientSession() as session:
        with pytest.raises(DeliveryError) as raised:
            await deliver(bot(feishu, secret=wrong), notification(job_alert()), session, FAST)
    error = raised.value
    assert error.reason == "bad_signature" and not error.retryable
    assert "Feishu rejected the signature (code 19021" in str(error)
    assert "Secret feishu-bot/signing-secret" in str(error)
    assert feishu.count("bot") == 1  # one request, no retries
    for value in [wrong, BOT_TOKEN]:
        assert value not in str(error) and value not in caplog.text


async def test_a_wrong_signing_secret_in_the_pipeline_pauses_the_receiver_and_leaks_nothing(feishu, pipelines, caplog):
    caplog.set_level(logging.DEBUG)
    # One request at a time: the first answer pauses the receiver before any other group's request goes.
    pipeline = await pipelines({"delivery": {"concurrency": 1}}, signing_secret="wrong-s1gning-secret")
    await pipeline.submit([job_alert(node=f"gpu-node-{i}") for i in range(5)])
    await wait_for(lambda: "team" in pipeline.last_error, what="the delivery error")
    await pipeline.wait_idle()
    assert "Feishu rejected the signature (code 19021" in pipeline.last_error["team"]
    assert feishu.count("bot") == 1  # the other four groups did not hammer Feishu with the same bad secret
    assert (
        metric(pipelines.registry, "rankwatch_alerts_failed_total", level="P1", receiver="team", reason="bad_signature")
        == 1
    )
    assert (
        metric(pipelines.registry, "rankwatch_alerts_failed_total", level="P1", receiver="team", reason="paused") == 4
    )
    assert "receiver paused" in caplog.text
    for value in [*SECRET_VALUES, "wrong-s1gning-secret"]:
        assert value not in caplog.text
        assert value not in repr(pipeline.receivers) and value not in repr(pipeline.config)


async def test_unsigned_card_to_a_bot_that_verifies_signatures_says_to_add_the_secret(feishu):
    async with aiohttp.ClientSession() as session:
        with pytest.raises(DeliveryError, match="add `secret`"):
            await deliver(bot(feishu, secret=None), notification(job_alert()), session, FAST)


async def test_rate_limit_code_9499_is_retried_after_backing_off(feishu):
    feishu.fail("bot", status=200, body={"code": 9499, "msg": "too many request", "data": {}})
    async with aiohttp.ClientSession() as session:
        attempts = await deliver(bot(feishu), notification(job_alert()), session, FAST)
    assert attempts == 2 and len(feishu.cards()) == 1


async def test_http_429_retry_after_is_honoured(feishu):
    feishu.fail(
        "bot", status=429, body={"code": 9499, "msg": "too many request", "data": {}}, headers={"Retry-After": "0.3"}
    )
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        await deliver(bot(feishu), notification(job_alert()), session, FAST)
    assert time.monotonic() - started >= 0.3
    assert len(feishu.cards()) == 1


async def test_server_errors_and_timeouts_are_retried_with_backoff(feishu):
    feishu.fail("bot", status=502)
    feishu.fail("bot", delay=1.0)  # longer than the 0.5 s timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FAST.timeout)) as session:
        attempts = await deliver(bot(feishu), notification(job_alert()), session, FAST)
    assert attempts == 3 and len(feishu.cards()) == 1


async def test_persistent_server_errors_give_up_after_the_attempts(feishu):
    feishu.fail("bot", times=3, status=503)
    async with aiohttp.ClientSession() as session:
        with pytest.raises(DeliveryError, match=r"HTTP 503 from 127.0.0.1:\d+") as raised:
            await deliver(bot(feishu), notification(job_alert()), session, FAST)
    assert raised.value.reason == "server_error" and feishu.count("bot") == 3
    assert BOT_TOKEN not in str(raised.value)


async def test_an_unreachable_bot_is_a_network_error_that_does_not_print_the_url(feishu):
    unreachable = FeishuBotReceiver(
        "team", FeishuBot(webhook_url=Secret(f"http://127.0.0.1:9/open-apis/bot/v2/hook/{BOT_TOKEN}", "s/k"))
    )
    async with aiohttp.ClientSession() as session:
        with pytest.raises(DeliveryError) as raised:
            await deliver(unreachable, notification(job_alert()), session, FAST)
    assert raised.value.reason == "network" and "cannot connect to 127.0.0.1:9" in str(raised.value)
    assert BOT_TOKEN not in str(raised.value)


def test_receivers_and_secrets_print_their_source_not_their_value(feishu):
    receiver = bot(feishu)
    assert SIGNING_SECRET not in repr(receiver) and BOT_TOKEN not in repr(receiver)
    assert "Secret(feishu-bot/signing-secret)" in repr(receiver)
    assert secrets_for(feishu)("feishu-bot", "signing-secret") == SIGNING_SECRET
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(receiver.config.secret)
