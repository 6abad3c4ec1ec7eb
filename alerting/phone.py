"""Feishu urgent phone calls through the Open Platform, to every listed user.

For each user: the alert card as a message from the app's bot (``POST /open-apis/im/v1/messages``),
then an urgent phone call on that message (``PATCH .../messages/{id}/urgent_phone``). Users are
called concurrently and independently: one unreachable user does not stop the others (Megatrace's
bot stopped at the first), and a retry calls only those not yet rung. Resolved notices are sent as
messages without a call. The tenant access token is cached until shortly before it expires.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from rankwatch.alerting import cards
from rankwatch.alerting.config import FeishuPhone
from rankwatch.alerting.delivery import DeliveryError
from rankwatch.alerting.messages import Message, Notification, WeeklyReport
from rankwatch.alerting.transport import Response, host_of, request_json, server_error

TOKEN_PATH = "/open-apis/auth/v3/tenant_access_token/internal"
MESSAGES_PATH = "/open-apis/im/v1/messages"
RATE_LIMITED = (99991400, 11232, 230020)
TOKEN_INVALID = (99991661, 99991663, 99991668)
TOKEN_MARGIN = 300.0
"""Seconds before expiry at which a cached token is replaced (Feishu hands out a new one then)."""


class FeishuPhoneReceiver:
    rings = True

    def __init__(self, name: str, config: FeishuPhone, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.config = config
        self._clock = clock
        self._token: tuple[str, float] | None = None
        self._token_lock = asyncio.Lock()
        self._progress: dict[str, dict[str, str | bool]] = {}
        """message key -> user -> message id sent to them, or True once rung."""
        self.who = f"Feishu phone receiver {name!r}"

    def __repr__(self) -> str:
        c = self.config
        return (
            f"FeishuPhoneReceiver(name={self.name!r}, base_url={c.base_url!r}, app_id={c.app_id!r}, "
            f"app_secret={c.app_secret!r}, users={len(c.user_ids)})"
        )

    async def send(self, message: Message, session: aiohttp.ClientSession) -> None:
        ring = not (isinstance(message, Notification) and not message.firing) and not isinstance(message, WeeklyReport)
        progress = self._progress.setdefault(message.key, {})
        pending = [user for user in self.config.user_ids if progress.get(user) is not True]
        results = await asyncio.gather(
            *(self._reach(session, user, message, ring, progress) for user in pending), return_exceptions=True
        )
        errors = [(user, r) for user, r in zip(pending, results, strict=True) if isinstance(r, BaseException)]
        for _, error in errors:
            if not isinstance(error, DeliveryError):
                raise error
        if not errors:
            self._progress.pop(message.key, None)
            return
        first: DeliveryError = errors[0][1]  # type: ignore[assignment]
        reached = len(self.config.user_ids) - len(errors)
        summary = "; ".join(f"{user}: {error}" for user, error in errors)
        raise DeliveryError(
            f"{self.who}: reached {reached} of {len(self.config.user_ids)} users; {summary}",
            first.reason,
            retryable=any(e.retryable for _, e in errors),  # type: ignore[union-attr]
            retry_after=max((e.retry_after or 0.0 for _, e in errors), default=None) or None,  # type: ignore[union-attr]
        )

    async def _reach(
        self, session: aiohttp.ClientSession, user: str, message: Message, ring: bool, progress: dict[str, str | bool]
    ) -> None:
        message_id = progress.get(user)
        if not isinstance(message_id, str):
            message_id = await self._send_message(session, user, message)
            progress[user] = message_id
        if ring:
            await self._ring(session, user, message_id)
        progress[user] = True

    async def _send_message(self, session: aiohttp.ClientSession, user: str, message: Message) -> str:
        body = {
            "receive_id": user,
            "msg_type": "interactive",
            "content": json.dumps(cards.card(message), ensure_ascii=False),
        }
        response = await self._call(
            session, "POST", MESSAGES_PATH, body, {"receive_id_type": self.config.user_id_type}, f"message to {user}"
        )
        message_id = ((response.body or {}).get("data") or {}).get("message_id")
        if not message_id:
            raise DeliveryError(f"{self.who}: message to {user}: no message_id in the answer", "rejected", False)
        return str(message_id)

    async def _ring(self, session: aiohttp.ClientSession, user: str, message_id: str) -> None:
        response = await self._call(
            session,
            "PATCH",
            f"{MESSAGES_PATH}/{message_id}/urgent_phone",
            {"user_id_list": [user]},
            {"user_id_type": self.config.user_id_type},
            f"urgent call to {user}",
        )
        invalid = ((response.body or {}).get("data") or {}).get("invalid_user_id_list") or []
        if user in invalid:
            raise DeliveryError(
                f"{self.who}: Feishu cannot call {user} (in invalid_user_id_list): check the user id "
                f"({self.config.user_id_type}) and that the app may reach this user",
                "rejected",
                retryable=False,
            )

    async def _call(
        self,
        session: aiohttp.ClientSession,
        method: str,
        path: str,
        body: dict[str, Any],
        params: dict[str, str],
        what: str,
    ) -> Response:
        who = f"{self.who}: {what}"
        for fresh_token in (False, True):
            token = await self._tenant_token(session, refresh=fresh_token)
            response = await request_json(
                session,
                method,
                self.config.base_url + path,
                who,
                body,
                headers={"Authorization": f"Bearer {token}"},
                params=params,
            )
            code = (response.body or {}).get("code")
            if code in TOKEN_INVALID and not fresh_token:
                continue  # revoked or expired early: one new token, then give up
            return self._check(response, who, code)
        raise AssertionError("unreachable")

    def _check(self, response: Response, who: str, code: Any) -> Response:
        text = (response.body or {}).get("msg", "")
        if response.status == 429 or code in RATE_LIMITED:
            raise DeliveryError(
                f"{who}: rate limited (HTTP {response.status}, code {code}: {text})",
                "rate_limited",
                retryable=True,
                retry_after=response.retry_after(),
            )
        if response.status >= 500:
            raise server_error(who, host_of(self.config.base_url), response)
        if code in TOKEN_INVALID:
            raise DeliveryError(f"{who}: access token refused (code {code}: {text})", "auth", retryable=False)
        if response.status >= 400 or code != 0:
            raise DeliveryError(
                f"{who}: refused (HTTP {response.status}, code {code}: {text})", "rejected", retryable=False
            )
        return response

    async def _tenant_token(self, session: aiohttp.ClientSession, refresh: bool) -> str:
        async with self._token_lock:
            now = self._clock()
            if self._token and not refresh and self._token[1] > now:
                return self._token[0]
            who = f"{self.who}: tenant_access_token"
            response = await request_json(
                session,
                "POST",
                self.config.base_url + TOKEN_PATH,
                who,
                {"app_id": self.config.app_id.reveal(), "app_secret": self.config.app_secret.reveal()},
            )
            body = response.body or {}
            code = body.get("code")
            if response.status == 429 or code in RATE_LIMITED:
                raise DeliveryError(f"{who}: rate limited", "rate_limited", True, response.retry_after())
            if response.status >= 500:
                raise server_error(who, host_of(self.config.base_url), response)
            if code != 0 or not body.get("tenant_access_token"):
                raise DeliveryError(
                    f"{who}: Feishu refused the app credentials (code {code}: {body.get('msg', '')}); check app_id "
                    f"({self.config.app_id.source}) and app_secret ({self.config.app_secret.source}). Not retrying.",
                    "auth",
                    retryable=False,
                )
            expire = float(body.get("expire", 7200))
            self._token = (str(body["tenant_access_token"]), now + max(expire - TOKEN_MARGIN, expire / 2))
            return self._token[0]
