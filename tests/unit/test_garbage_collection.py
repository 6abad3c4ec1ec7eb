"""The operator's collector settings: what a middle or full collection leaves alive is frozen (later
collections skip it), garbage made afterwards is still collected, and a thaw hands the frozen objects
back and collects the cycles among them that became garbage."""

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
    gc.callbacks.remove(garbage_collection._freeze_survivors)
    gc.unfreeze()
    gc.set_threshold(*thresholds)


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> tuple[Node, weakref.ref]:
    """A reference cycle, and a weak reference that says whether it was collected."""
    first, second = Node(), Node()
    first.other, second.other = second, first
    return first, weakref.ref(first)


def test_a_middle_collection_freezes_what_lived_and_later_cycles_are_still_collected(tuned):
    state = [{"rank": rank, "waits": [0.1, 0.2]} for rank in range(1000)]  # the long-lived job state
    gc.collect(1)
    assert gc.get_freeze_count() >= len(state), "the state survived a middle collection: frozen"
    assert not gc.get_objects(2), "nothing left in the old generation for a full collection to walk"
    garbage = cycle()[1]  # made after the freeze, held by nothing
    gc.collect(1)
    assert garbage() is None
    state.clear()  # frozen objects replaced are freed by reference counting, as before


def test_a_thaw_collects_the_cycles_that_became_garbage_while_frozen(tuned):
    held, garbage = cycle()
    gc.collect(1)
    assert gc.get_freeze_count() > 0
    del held  # a frozen cycle dropped: no collection sees it until the thaw
    gc.collect(1)
    assert garbage() is not None

    async def thaw_once() -> None:
        task = asyncio.create_task(garbage_collection.thaw_periodically(0.01))
        await asyncio.sleep(0.1)
        task.cancel()

    asyncio.run(thaw_once())
    assert garbage() is None, "the thaw collected the frozen cycle"
    assert gc.get_threshold() == garbage_collection.THRESHOLDS
