"""One HTTP request with a JSON body and answer, failures turned into ``DeliveryError``.

aiohttp's own exception texts can carry the request URL, and a Feishu webhook URL is a
credential, so the messages here are built from the host name and the exception type only.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from rankwatch.alerting.delivery import DeliveryError


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]
    body: dict[str, Any] | None
    """The JSON object answered, None when the body was not a JSON object."""

    def retry_after(self) -> float | None:
        """Seconds the server asked us to wait (``Retry-After``, Feishu's ``x-ogw-ratelimit-reset``)."""
        for name in ("retry-after", "x-ogw-ratelimit-reset"):
            value = self.headers.get(name)
            if value:
                try:
                    return max(0.0, float(value))
                except ValueError:
                    continue
        return None


def host_of(url: str) -> str:
    return urlsplit(url).netloc or "?"


async def request_json(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    who: str,
    payload: dict[str, Any],
    headers: dict[str, str] | None = None,
    params: dict[str, str] | None = None,
) -> Response:
    host = host_of(url)
    try:
        async with session.request(method, url, json=payload, headers=headers, params=params) as answer:
            raw = await answer.read()
            status = answer.status
            answer_headers = {k.lower(): v for k, v in answer.headers.items()}
    except TimeoutError:
        raise DeliveryError(f"{who}: no answer from {host} in time", "timeout", retryable=True) from None
    except aiohttp.ClientConnectorError as error:
        reason = error.os_error.strerror if error.os_error and error.os_error.strerror else type(error).__name__
        raise DeliveryError(f"{who}: cannot connect to {host} ({reason})", "network", retryable=True) from None
    except aiohttp.ClientError as error:
        raise DeliveryError(f"{who}: {type(error).__name__} talking to {host}", "network", retryable=True) from None
    except asyncio.CancelledError:
        raise
    try:
        body = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    return Response(status, answer_headers, body if isinstance(body, dict) else None)


def server_error(who: str, host: str, response: Response) -> DeliveryError:
    return DeliveryError(f"{who}: HTTP {response.status} from {host}", "server_error", retryable=True)
