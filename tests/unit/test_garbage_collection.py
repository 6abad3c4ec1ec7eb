"""The operator's collector settings: what a full collection leaves alive is frozen (later collections
skip it), garbage made afterwards is still collected, and a thaw hands the frozen objects back."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from rankwatch.operator import garbage_collection


@pytest.fixture
def tuned():
    thresholds = gc.get_threshold()
    garbage_collection.tune()
    yield
    gc.callbacks.remove(garbage_collection._freeze_after_full)
    gc.unfreeze()
    gc.set_threshold(*thresholds)


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref:
    """A reference cycle nothing else holds, and a weak reference that says whether it was collected."""
    first, second = Node(), Node()
    first.other, second.other = second, first
    return weakref.ref(first)


def test_a_full_collection_freezes_what_lived_and_later_cycles_are_still_collected(tuned):
    state = [{"rank": rank, "waits": [0.1, 0.2]} for rank in range(1000)]  # the long-lived job state
    gc.collect()
    assert gc.get_freeze_count() >= len(state), "the state survived a full collection: frozen"
    assert garbage_collection._freeze_after_full in gc.callbacks
    garbage = cycle()
    gc.collect(1)  # a middle collection still finds garbage made after the freeze
    assert garbage() is None
    state.clear()  # frozen objects replaced are freed by reference counting, as before


def test_a_thaw_hands_the_frozen_objects_back(tuned):
    gc.collect()
    assert gc.get_freeze_count() > 0

    async def thaw_once() -> None:
        task = asyncio.create_task(garbage_collection.thaw_periodically(0.01))
        await asyncio.sleep(0.1)
        task.cancel()

    asyncio.run(thaw_once())
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == garbage_collection.THRESHOLDS
