"""Feishu custom bot: an interactive card posted to the group's webhook, signed as Feishu documents.

Signature: ``base64(HMAC-SHA256(key="<timestamp>\\n<secret>", message=b""))`` with the timestamp in
seconds, as a string, sent in the body beside it; Feishu refuses a timestamp more than an hour
off. Answers are ``{"code": 0, "msg": "success", "data": {}}`` (older bots: ``StatusCode``); the
codes acted on are below.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from rankwatch.alerting import cards
from rankwatch.alerting.config import FeishuBot
from rankwatch.alerting.delivery import DeliveryError
from rankwatch.alerting.messages import Message
from rankwatch.alerting.transport import Response, host_of, request_json, server_error

BAD_SIGNATURE = 19021  # "sign match fail or timestamp is not within one hour from current time"
IP_NOT_ALLOWED = 19022
KEYWORD_MISSING = 19024
RATE_LIMITED = (9499, 11232)  # bot frequency limit (100/min, 5/s per bot); HTTP 429 likewise


def sign(timestamp: str, secret: str) -> str:
    key = f"{timestamp}\n{secret}".encode()
    return base64.b64encode(hmac.new(key, b"", hashlib.sha256).digest()).decode()


class FeishuBotReceiver:
    rings = False

    def __init__(self, name: str, config: FeishuBot, clock: Callable[[], float] = time.time) -> None:
        self.name = name
        self.config = config
        self._clock = clock

    def __repr__(self) -> str:
        c = self.config
        return f"FeishuBotReceiver(name={self.name!r}, webhook_url={c.webhook_url!r}, secret={c.secret!r})"

    def body(self, message: Message) -> dict[str, Any]:
        body: dict[str, Any] = {"msg_type": "interactive", "card": cards.card(message, self.config.mentions)}
        if self.config.secret is not None:
            timestamp = str(int(self._clock()))
            body["timestamp"] = timestamp
            body["sign"] = sign(timestamp, self.config.secret.reveal())
        return body

    async def send(self, message: Message, session: aiohttp.ClientSession) -> None:
        url = self.config.webhook_url.reveal()
        who = f"Feishu receiver {self.name!r}"
        response = await request_json(session, "POST", url, who, self.body(message))
        check(response, who, host_of(url), self.config)


def check(response: Response, who: str, host: str, config: FeishuBot) -> None:
    body = response.body or {}
    code = body.get("code", body.get("StatusCode"))
    text = body.get("msg", body.get("StatusMessage", ""))
    if response.status == 429 or code in RATE_LIMITED:
        raise DeliveryError(
            f"{who}: rate limited by Feishu (HTTP {response.status}, code {code}: {text})",
            "rate_limited",
            retryable=True,
            retry_after=response.retry_after(),
        )
    if response.status >= 500:
        raise server_error(who, host, response)
    if code == BAD_SIGNATURE:
        if config.secret is None:
            hint = "the bot has signature verification on: add `secret` (its signing secret) to this receiver"
        else:
            hint = (
                f"check that Secret {config.secret.source} holds the bot's current signing secret "
                "and that this machine's clock is right"
            )
        raise DeliveryError(
            f"{who}: Feishu rejected the signature (code {code}: {text}); {hint}. Not retrying.",
            "bad_signature",
            retryable=False,
        )
    if code in (IP_NOT_ALLOWED, KEYWORD_MISSING):
        hint = "the bot's IP allow-list" if code == IP_NOT_ALLOWED else "the bot's required keywords"
        raise DeliveryError(f"{who}: refused by {hint} (code {code}: {text})", "rejected", retryable=False)
    if response.status >= 400 or code not in (0, None) or response.body is None:
        raise DeliveryError(
            f"{who}: Feishu refused the card (HTTP {response.status}, code {code}: {text})", "rejected", retryable=False
        )
