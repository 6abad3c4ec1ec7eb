"""A local Feishu for tests and benchmarks: custom-bot webhooks and the Open Platform calls we use.

It speaks the protocol as Feishu documents it and checks what Feishu checks: the bot signature
(``base64(HMAC-SHA256(key="<timestamp>\\n<secret>", msg=b""))``, timestamp within an hour), the
bot token in the URL, app credentials, ``Bearer`` tenant tokens, ``receive_id_type`` /
``user_id_type``, message ids for urgent calls; it answers with Feishu's shapes
(``{"code": ..., "msg": ..., "data": {...}}``). Faults on demand: a delay, HTTP 5xx, rate limits
(HTTP 429 or code 9499), per kind of request. Everything received is recorded for assertions.
Not a mock of our client: nothing here knows how rankwatch builds its requests.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

BOT_PATH = "/open-apis/bot/v2/hook/{token}"
SIGN_FAILED = {
    "code": 19021,
    "data": {},
    "msg": "sign match fail or timestamp is not within one hour from current time",
}
TOKEN_INVALID = {"code": 19001, "data": {}, "msg": "param invalid: incoming webhook access token invalid"}
RATE_LIMITED = {"code": 9499, "data": {}, "msg": "too many request"}
OK = {"code": 0, "data": {}, "msg": "success"}


@dataclass
class Fault:
    kind: str
    """bot | token | message | urgent | webhook | any"""
    status: int = 500
    body: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0


@dataclass
class Received:
    kind: str
    path: str
    body: Any
    at: float
    headers: dict[str, str]


class FakeFeishu:
    def __init__(self) -> None:
        self.bots: dict[str, str | None] = {}
        """bot token -> signing secret (None: signature verification off)."""
        self.apps: dict[str, str] = {}
        self.users: set[str] = set()
        self.uncallable: set[str] = set()
        """Users the urgent call reports in ``invalid_user_id_list``."""
        self.received: list[Received] = []
        self.accepted = 0
        """Bot messages accepted (cheap to poll, unlike ``cards()``)."""
        self.calls: list[tuple[str, str]] = []
        """(message id, user id) for every urgent phone call made."""
        self.messages: dict[str, dict[str, Any]] = {}
        self.delay = 0.0
        self.faults: list[Fault] = []
        self.token_ttl = 7200
        self._tokens: dict[str, float] = {}
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- setup ----------------------------------------------------------------------------------

    def add_bot(self, token: str, secret: str | None = None) -> str:
        self.bots[token] = secret
        return self.bot_url(token)

    def add_app(self, app_id: str, app_secret: str, users: list[str]) -> None:
        self.apps[app_id] = app_secret
        self.users.update(users)

    def fail(self, kind: str, times: int = 1, **fault: Any) -> None:
        self.faults.extend(Fault(kind, **fault) for _ in range(times))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def bot_url(self, token: str) -> str:
        return self.base_url + BOT_PATH.format(token=token)

    async def start(self) -> FakeFeishu:
        app = web.Application()
        app.router.add_post(BOT_PATH, self._bot)
        app.router.add_post("/open-apis/auth/v3/tenant_access_token/internal", self._token)
        app.router.add_post("/open-apis/im/v1/messages", self._message)
        app.router.add_patch("/open-apis/im/v1/messages/{message_id}/urgent_phone", self._urgent)
        app.router.add_post("/webhook/{name}", self._webhook)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> FakeFeishu:
        return await self.start()

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    # -- what arrived ---------------------------------------------------------------------------

    def cards(self, token: str | None = None) -> list[dict[str, Any]]:
        """Cards the bots accepted (signature and token good), oldest first."""
        return [
            r.body["card"]
            for r in self.received
            if r.kind == "bot" and r.body.get("_accepted") and (token is None or r.path.endswith("/" + token))
        ]

    def webhooks(self, name: str | None = None) -> list[dict[str, Any]]:
        return [r.body for r in self.received if r.kind == "webhook" and (name is None or r.path.endswith("/" + name))]

    def count(self, kind: str) -> int:
        return sum(r.kind == kind for r in self.received)

    # -- handlers -------------------------------------------------------------------------------

    async def _fault(self, kind: str) -> web.Response | None:
        if self.delay:
            await asyncio.sleep(self.delay)
        for index, fault in enumerate(self.faults):
            if fault.kind in (kind, "any"):
                del self.faults[index]
                if fault.delay:
                    await asyncio.sleep(fault.delay)
                    return None
                return web.json_response(
                    fault.body if fault.body is not None else {"code": fault.status, "msg": "injected", "data": {}},
                    status=fault.status,
                    headers=fault.headers,
                )
        return None

    async def _record(self, kind: str, request: web.Request) -> Any:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        self.received.append(Received(kind, request.path_qs, body, time.time(), dict(request.headers)))
        return body

    async def _bot(self, request: web.Request) -> web.Response:
        body = await self._record("bot", request)
        fault = await self._fault("bot")
        if fault is not None:
            return fault
        token = request.match_info["token"]
        if token not in self.bots:
            return web.json_response(TOKEN_INVALID)
        if not isinstance(body, dict) or body.get("msg_type") not in ("interactive", "text", "post"):
            return web.json_response({"code": 9499, "data": {}, "msg": "Bad Request"}, status=400)
        secret = self.bots[token]
        if secret is not None:
            timestamp = str(body.get("timestamp", ""))
            expected = ""
            if timestamp.isdigit():
                key = f"{timestamp}\n{secret}".encode()
                expected = base64.b64encode(hmac.new(key, b"", hashlib.sha256).digest()).decode()
            fresh = timestamp.isdigit() and abs(time.time() - int(timestamp)) <= 3600
            if not fresh or not hmac.compare_digest(expected, str(body.get("sign", ""))):
                return web.json_response(SIGN_FAILED)
        if body["msg_type"] == "interactive":
            card = body.get("card")
            if not isinstance(card, dict) or not isinstance(card.get("elements"), list):
                return web.json_response({"code": 11246, "data": {}, "msg": "card content is invalid"})
        body["_accepted"] = True
        self.accepted += 1
        return web.json_response(OK)

    async def _token(self, request: web.Request) -> web.Response:
        body = await self._record("token", request)
        fault = await self._fault("token")
        if fault is not None:
            return fault
        body = body if isinstance(body, dict) else {}
        app_id, app_secret = body.get("app_id"), body.get("app_secret")
        if app_id not in self.apps:
            return web.json_response({"code": 10003, "msg": "invalid param"}, status=400)
        if self.apps[app_id] != app_secret:
            return web.json_response({"code": 10014, "msg": "app secret invalid"}, status=400)
        token = f"t-{next(self._ids):08x}{hashlib.sha256(str(time.time()).encode()).hexdigest()[:16]}"
        self._tokens[token] = time.time() + self.token_ttl
        return web.json_response({"code": 0, "msg": "ok", "tenant_access_token": token, "expire": self.token_ttl})

    def _authorised(self, request: web.Request) -> web.Response | None:
        header = request.headers.get("Authorization", "")
        token = header.removeprefix("Bearer ")
        if not header.startswith("Bearer ") or self._tokens.get(token, 0) < time.time():
            return web.json_response(
                {"code": 99991663, "msg": "Invalid access token for authorization. Please make a request with token."},
                status=400,
            )
        return None

    async def _message(self, request: web.Request) -> web.Response:
        body = await self._record("message", request)
        fault = await self._fault("message") or self._authorised(request)
        if fault is not None:
            return fault
        id_type = request.query.get("receive_id_type")
        if id_type not in ("open_id", "user_id", "union_id", "email", "chat_id"):
            return web.json_response({"code": 99992402, "msg": "field validation failed", "data": {}}, status=400)
        body = body if isinstance(body, dict) else {}
        receive_id = body.get("receive_id")
        try:
            content = json.loads(body.get("content", ""))
        except (json.JSONDecodeError, TypeError):
            return web.json_response({"code": 230001, "msg": "invalid message content", "data": {}}, status=400)
        if receive_id not in self.users:
            return web.json_response({"code": 230013, "msg": "Bot has NO availability to this user.", "data": {}})
        message_id = f"om_{next(self._ids):016x}"
        self.messages[message_id] = {"receive_id": receive_id, "msg_type": body.get("msg_type"), "content": content}
        return web.json_response(
            {"code": 0, "msg": "success", "data": {"message_id": message_id, "msg_type": body.get("msg_type")}}
        )

    async def _urgent(self, request: web.Request) -> web.Response:
        body = await self._record("urgent", request)
        fault = await self._fault("urgent") or self._authorised(request)
        if fault is not None:
            return fault
        message_id = request.match_info["message_id"]
        if request.query.get("user_id_type") not in ("open_id", "user_id", "union_id"):
            return web.json_response({"code": 99992402, "msg": "field validation failed", "data": {}}, status=400)
        if message_id not in self.messages:
            return web.json_response({"code": 230001, "msg": "message not found", "data": {}}, status=400)
        users = (body or {}).get("user_id_list")
        if not isinstance(users, list) or not users:
            return web.json_response({"code": 99992402, "msg": "field validation failed", "data": {}}, status=400)
        invalid = [u for u in users if u not in self.users or u in self.uncallable]
        self.calls.extend((message_id, user) for user in users if user not in invalid)
        return web.json_response({"code": 0, "msg": "success", "data": {"invalid_user_id_list": invalid}})

    async def _webhook(self, request: web.Request) -> web.Response:
        await self._record("webhook", request)
        fault = await self._fault("webhook")
        return fault if fault is not None else web.json_response({"status": "ok"})
