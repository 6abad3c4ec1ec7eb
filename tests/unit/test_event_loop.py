"""The operator's event loop is the one its config names."""

import asyncio

import pytest

from rankwatch.operator import event_loop


async def _loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_the_operator_runs_on_uvloop_when_configured():
    pytest.importorskip("uvloop")
    assert event_loop.run(_loop_module(), "uvloop").startswith("uvloop")


def test_the_operator_runs_on_asyncios_loop_by_default():
    assert event_loop.run(_loop_module()).startswith("asyncio")
