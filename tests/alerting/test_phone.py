"""Feishu urgent phone: every recipient is rung, one at fault does not stop the others, tokens are reused."""

from __future__ import annotations

import aiohttp
import pytest
from alerting_support import APP_ID, APP_SECRET, USERS, job_alert

from rankwatch.alerting.config import DeliveryConfig, FeishuPhone
from rankwatch.alerting.delivery import DeliveryError, deliver
from rankwatch.alerting.messages import Notification
from rankwatch.alerting.model import Level
from rankwatch.alerting.phone import FeishuPhoneReceiver
from rankwatch.alerting.secrets import Secret

FAST = DeliveryConfig(timeout=1.0, attempts=3, backoff=0.01, max_backoff=0.05)


def phone(feishu, app_secret: str = APP_SECRET, users: list[str] = USERS) -> FeishuPhoneReceiver:
    return FeishuPhoneReceiver(
        "oncall-phone",
        FeishuPhone(
            app_id=Secret(APP_ID, "feishu-app/app-id"),
            app_secret=Secret(app_secret, "feishu-app/app-secret"),
            user_ids=tuple(users),
            base_url=feishu.base_url,
        ),
    )


def page(*, resolved: bool = False, node: str = "gpu-node-1") -> Notification:
    alert = job_alert(level=Level.P0, name="TrainingJobHang", node=node)
    if resolved:
        return Notification("oncall-phone", "g", {}, (), (alert.resolve(alert.starts_at + 60),))
    return Notification("oncall-phone", "g", {}, (alert,))


async def test_every_user_gets_the_card_and_a_call(feishu):
    async with aiohttp.ClientSession() as session:
        await deliver(phone(feishu), page(), session, FAST)
    assert sorted(user for _, user in feishu.calls) == sorted(USERS)
    for message_id, user in feishu.calls:
        sent = feishu.messages[message_id]
        assert sent["receive_id"] == user and sent["msg_type"] == "interactive"
        assert sent["content"]["header"]["template"] == "red"
    tokens = {r.headers["Authorization"] for r in feishu.received if r.kind in ("message", "urgent")}
    assert len(tokens) == 1 and feishu.count("token") == 1


async def test_one_unreachable_user_does_not_stop_the_others_and_a_retry_rings_only_the_missing(feishu):
    receiver = phone(feishu)
    feishu.fail("urgent", status=500)  # the first call attempt fails with a server error
    async with aiohttp.ClientSession() as session:
        await deliver(receiver, page(), session, FAST)
    assert sorted(user for _, user in feishu.calls) == sorted(USERS)  # each rung exactly once
    assert feishu.count("message") == len(USERS)  # the failed user's message was not sent twice


async def test_a_user_feishu_cannot_call_is_named_and_the_rest_are_rung(feishu):
    feishu.uncallable.add("u-bob")
    async with aiohttp.ClientSession() as session:
        with pytest.raises(DeliveryError, match=r"reached 2 of 3 users; u-bob: .*cannot call u-bob") as raised:
            await deliver(phone(feishu), page(), session, FAST)
    assert not raised.value.retryable
    assert sorted(user for _, user in feishu.calls) == ["u-alice", "u-carol"]


async def test_a_resolved_notice_is_a_message_without_a_call(feishu):
    async with aiohttp.ClientSession() as session:
        await deliver(phone(feishu), page(resolved=True), session, FAST)
    assert feishu.calls == [] and feishu.count("message") == len(USERS)


async def test_the_token_is_reused_and_renewed_when_feishu_refuses_it(feishu):
    receiver = phone(feishu, users=["u-alice"])
    async with aiohttp.ClientSession() as session:
        await deliver(receiver, page(), session, FAST)
        feishu._tokens.clear()  # Feishu revoked it early
        await deliver(receiver, page(node="gpu-node-2"), session, FAST)
    assert feishu.count("token") == 2 and len(feishu.calls) == 2


async def test_wrong_app_credentials_are_a_clear_error_not_retried_and_not_printed(feishu):
    async with aiohttp.ClientSession() as session:
        with pytest.raises(DeliveryError) as raised:
            await deliver(phone(feishu, app_secret="wrong-app-s3cret"), page(), session, FAST)
    error = raised.value
    assert error.reason == "auth" and not error.retryable
    assert "Feishu refused the app credentials (code 10014: app secret invalid)" in str(error)
    assert "feishu-app/app-secret" in str(error)
    assert "wrong-app-s3cret" not in str(error) and APP_SECRET not in str(error)
    assert feishu.count("token") == len(USERS)  # one try per user, no retries


async def test_open_platform_rate_limit_waits_for_the_reset_header(feishu):
    feishu.fail(
        "message",
        status=429,
        body={"code": 99991400, "msg": "request trigger frequency limit"},
        headers={"x-ogw-ratelimit-reset": "0.2"},
    )
    async with aiohttp.ClientSession() as session:
        attempts = await deliver(phone(feishu, users=["u-alice"]), page(), session, FAST)
    assert attempts == 2 and len(feishu.calls) == 1
