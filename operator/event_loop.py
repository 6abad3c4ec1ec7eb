"""The event loop the operator runs on: asyncio's own, or uvloop's (``RANKWATCH_EVENT_LOOP=uvloop``).

Why a choice: the collector's HTTP handling is most of the event loop's work at scale, and uvloop
(libuv, the loop kopf itself picks when run from its CLI) does the socket and timer part of it in C.
uvloop is an optional dependency (``pip install 'rankwatch[uvloop]'``); asyncio's loop is the default.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

EVENT_LOOPS = ("asyncio", "uvloop")
T = TypeVar("T")


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What makes the loop named ``name`` (None: asyncio's default); ValueError names what to do."""
    if name == "asyncio":
        return None
    if name == "uvloop":
        try:
            import uvloop
        except ImportError:
            raise ValueError("uvloop is not installed: pip install 'rankwatch[uvloop]', or use asyncio") from None
        return uvloop.new_event_loop
    raise ValueError(f"must be one of {', '.join(EVENT_LOOPS)}")


def run(main: Coroutine[Any, Any, T], name: str = "asyncio") -> T:
    """``asyncio.run(main)`` on the loop named ``name``."""
    with asyncio.Runner(loop_factory=loop_factory(name)) as runner:
        return runner.run(main)
