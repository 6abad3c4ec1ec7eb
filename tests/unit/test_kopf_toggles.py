"""kopf's index start-up with thousands of worker pods: each object indexed wakes only what it can
release, so a restarted operator gets to its handlers in time linear in the pods."""

from __future__ import annotations

import asyncio

import pytest
from kopf._cogs.aiokits import aiotoggles

from rankwatch.operator import kopf_toggles


@pytest.fixture
def quiet_toggles(monkeypatch: pytest.MonkeyPatch) -> None:
    for method in ("make_toggle", "drop_toggle", "drop_toggles"):  # put back after the test
        monkeypatch.setattr(aiotoggles.ToggleSet, method, getattr(aiotoggles.ToggleSet, method))
    assert kopf_toggles.wake_only_on_flips()


async def index_start_up(objects: int) -> int:
    """kopf's pre-population as it runs: one toggle per listed object, made as the object arrives from
    the watch; its worker drops it once indexed and waits for the whole set. Returns how many times a
    set's state was asked (each wake-up of a waiter asks once)."""
    toggles = aiotoggles.ToggleSet(all)
    asked = 0
    is_on = toggles.is_on

    def counted() -> bool:
        nonlocal asked
        asked += 1
        return is_on()

    toggles.is_on = counted  # type: ignore[method-assign]
    listing = await toggles.make_toggle(name="pods listed")

    async def worker(toggle: aiotoggles.Toggle) -> None:
        await asyncio.sleep(0)
        await toggles.drop_toggle(toggle)
        await toggles.wait_for(True)

    workers = []
    for index in range(objects):
        toggle = await toggles.make_toggle(name=f"pod-{index}")
        workers.append(asyncio.create_task(worker(toggle)))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    await toggles.drop_toggle(listing)
    await asyncio.wait_for(asyncio.gather(*workers), 30)
    assert toggles.is_on() and not len(toggles)
    return asked


def test_pods_indexed_one_by_one_wake_the_waiters_once_not_at_every_pod(quiet_toggles):
    objects = 400
    asked = asyncio.run(index_start_up(objects))
    # kopf 1.45 as it is: every drop wakes every waiting worker, ~objects²/2 = 80,000 questions
    assert asked < 10 * objects, f"{asked} wake-ups for {objects} objects"


def test_a_set_still_wakes_its_waiters_when_it_flips_either_way(quiet_toggles):
    async def flips() -> None:
        toggles = aiotoggles.ToggleSet(all)
        assert toggles.is_on(), "an empty all-set is on"
        turned_off = asyncio.create_task(toggles.wait_for(False))
        await asyncio.sleep(0)
        blocker = await toggles.make_toggle(False, name="blocker")
        await asyncio.wait_for(turned_off, 1)
        already_on = await toggles.make_toggle(True, name="ready")
        turned_on = asyncio.create_task(toggles.wait_for(True))
        await asyncio.sleep(0.01)
        assert not turned_on.done()
        await toggles.drop_toggle(blocker)
        await asyncio.wait_for(turned_on, 1)
        own = asyncio.create_task(already_on.wait_for(False))  # a toggle's own waiters: unchanged
        await already_on.turn_to(False)
        await asyncio.wait_for(own, 1)
        assert not toggles.is_on()

    asyncio.run(flips())
