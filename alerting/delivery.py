"""Getting one message to one receiver: retries with backoff for what may pass, a clear stop otherwise.

Receivers raise ``DeliveryError`` saying whether trying again can help (a 5xx, a timeout, a rate
limit with the wait the server asked for) or not (a rejected signature or credential: retrying
would only hammer Feishu with requests that cannot succeed). Messages never contain credentials:
receivers build them from the host name and the server's code and text only.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Protocol

import aiohttp

from rankwatch.alerting.config import DeliveryConfig
from rankwatch.alerting.messages import Message

log = logging.getLogger(__name__)

REASONS = ("rate_limited", "bad_signature", "auth", "rejected", "server_error", "timeout", "network", "paused")
"""Every value of the ``reason`` metrics label (bounded)."""


class DeliveryError(Exception):
    def __init__(self, message: str, reason: str, retryable: bool, retry_after: float | None = None) -> None:
        assert reason in REASONS, reason
        super().__init__(message)
        self.reason = reason
        self.retryable = retryable
        self.retry_after = retry_after

    @property
    def config_problem(self) -> bool:
        """Fixing it needs a person (secret, credentials, bot settings), not time."""
        return self.reason in ("bad_signature", "auth")


class Receiver(Protocol):
    name: str
    rings: bool
    """A phone receiver: its messages are calls (tests and the storm summary say so)."""

    async def send(self, message: Message, session: aiohttp.ClientSession) -> None:
        """Deliver or raise ``DeliveryError``. Safe to call again for the same message after an error."""


async def deliver(
    receiver: Receiver,
    message: Message,
    session: aiohttp.ClientSession,
    policy: DeliveryConfig,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> int:
    """Send with up to ``policy.attempts`` tries; returns the attempts used, raises the last error."""
    for attempt in range(1, policy.attempts + 1):
        try:
            await receiver.send(message, session)
            return attempt
        except DeliveryError as error:
            if not error.retryable or attempt == policy.attempts:
                raise
            delay = min(policy.max_backoff, policy.backoff * 2 ** (attempt - 1)) * random.uniform(0.8, 1.2)
            if error.retry_after is not None:
                delay = max(delay, min(error.retry_after, max(policy.max_backoff, 1.0)))
            log.warning(
                "receiver %s: attempt %d/%d failed (%s); retrying in %.2fs",
                receiver.name,
                attempt,
                policy.attempts,
                error,
                delay,
            )
            await sleep(delay)
    raise AssertionError("unreachable")
