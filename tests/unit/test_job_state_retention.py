"""A running job's state stops growing once its histories are full: windows accumulating for hours cost
the operator no more memory than the first minute did (the readers' retention, job_state's constants)."""

from __future__ import annotations

import gc
import sys
import types

from rankwatch.operator.diagnosis.ingest.job_state import (
    DEDUPE_WINDOWS,
    HOST_WINDOWS,
    NEVER,
    RECORDS_HISTORY,
    WAIT_HISTORY,
    JobState,
    JobStore,
    StateLimits,
    SummaryDigest,
)

PODS, RANKS_PER_POD, COMMS = 16, 8, 4
WINDOW_NS = 5_000_000_000


def digest(pod: int, window: int) -> SummaryDigest:
    """One pod's window as the parsing worker digests it: every rank on ``COMMS`` communicators with a
    wait, scheduling figures and a step time (every history of the state is fed)."""
    start, sequence = window * WINDOW_NS, 1000 + 10 * window  # past the small ints Python shares
    comms = tuple((f"comm-{c}", 8, sequence, sequence, 0, None, 10, 0.002 + 1e-6 * window) for c in range(COMMS))
    ranks = tuple(
        (
            pod * RANKS_PER_POD + local,
            True,
            1000 + window,
            0.5,
            (0.001 * window, 1000 + window),
            comms,
        )
        for local in range(RANKS_PER_POD)
    )
    return SummaryDigest("team-a", "llama", f"llama-worker-{pod}", f"node-{pod}", pod, window, start,
                         start + WINDOW_NS, 0, 0.1, ranks)  # fmt: skip


def take_window(state: JobState, window: int) -> None:
    """Every pod's summary of ``window``, checked and folded as the collector does."""
    for pod in range(PODS):
        message = digest(pod, window)
        assert not state.duplicate((message.pod, message.start_ns, message.window))
        assert state.replayed(message) is None
        state.add_digest(message, now=5.0 * window)


def entries(state: JobState) -> dict[str, int]:
    """What the state's histories hold, summed over the job: slots written, and slots at all."""

    def written(ring: list, width: int) -> int:
        return sum(ring[slot] != NEVER for slot in range(0, len(ring), width))

    ranks, pods = state.ranks.values(), state.pods.values()
    comms = [comm for rank in ranks for comm in rank.comms.values()]
    return {
        "waits": sum(written(comm.waits, 2) for comm in comms),
        "wait_slots": sum(len(comm.waits) for comm in comms),
        "records": sum(sum(count > 0 for count in rank.records) for rank in ranks),
        "record_slots": sum(len(rank.records) for rank in ranks),
        "scheduling": sum(written(rank.scheduling, 4) for rank in ranks),
        "scheduling_slots": sum(len(rank.scheduling) for rank in ranks),
        "cpu_pressure": sum(written(pod.cpu_pressure, 2) for pod in pods),
        "step_times": len(state.step_times),
        "dedupe_keys": len(state._seen),
    }


def held_bytes(state: JobState) -> int:
    """Bytes of every object the state holds. Not the process's traced memory: in a whole test run other
    threads (event loops of earlier tests) allocate beside the folds."""
    return sum(map(sys.getsizeof, _reachable(state).values()))


def test_a_jobs_state_stops_growing_once_its_histories_are_full():
    state = JobStore().get("team-a", "llama", StateLimits.for_job(PODS * RANKS_PER_POD, PODS))
    ranks, comms = PODS * RANKS_PER_POD, PODS * RANKS_PER_POD * COMMS
    for window in range(RECORDS_HISTORY * 2):
        take_window(state, window)
    full, full_bytes = entries(state), held_bytes(state)
    for window in range(RECORDS_HISTORY * 2, RECORDS_HISTORY * 10):
        take_window(state, window)
    later, later_bytes = entries(state), held_bytes(state)
    assert later == full, "eight more minutes of windows kept more entries"
    first = JobStore().get("team-a", "llama", StateLimits.for_job(PODS * RANKS_PER_POD, PODS))
    take_window(first, 0)
    slots = ("wait_slots", "record_slots", "scheduling_slots")
    assert {key: entries(first)[key] for key in slots} == {key: full[key] for key in slots}, "rings made whole"
    assert full["waits"] == WAIT_HISTORY * comms, "waits: what the detector reads"
    assert full["records"] == RECORDS_HISTORY * ranks
    assert full["scheduling"] == HOST_WINDOWS * ranks
    assert full["dedupe_keys"] == DEDUPE_WINDOWS * state.limits.pods
    # The same entries, replaced: the bytes held stay put too (a little slack for the allocator's pools).
    assert later_bytes <= full_bytes * 1.01, (full_bytes, later_bytes)


def test_a_redelivered_recent_window_is_still_told_from_a_new_one():
    state = JobStore().get("team-a", "llama", StateLimits.for_job(PODS * RANKS_PER_POD, PODS))
    for window in range(30):
        take_window(state, window)
    for window in range(30 - DEDUPE_WINDOWS, 30):
        newest = digest(3, window)
        assert state.duplicate((newest.pod, newest.start_ns, newest.window)), f"window {window} taken twice"
    older = digest(3, 30 - DEDUPE_WINDOWS - 5)
    assert state.replayed(older) is not None, "an older window is still refused (as replayed)"


def test_a_summary_folded_into_a_full_state_leaves_no_young_objects_per_rank():
    """The young generation's threshold counts allocations net of deallocations: objects that replace
    others in the state would pile up in it uncounted, and each young collection would walk them all."""
    state = JobStore().get("team-a", "llama", StateLimits.for_job(PODS * RANKS_PER_POD, PODS))
    for window in range(RECORDS_HISTORY + 2):
        take_window(state, window)
    messages = [digest(pod, RECORDS_HISTORY + 2) for pod in range(PODS)]
    gc.collect()
    gc.disable()
    try:
        for message in messages:
            assert not state.duplicate((message.pod, message.start_ns, message.window))
            state.add_digest(message, now=5.0 * (RECORDS_HISTORY + 2))
        young = gc.get_objects(generation=0)
    finally:
        gc.enable()
    # Only what the state holds: in a whole test run other threads (event loops of earlier tests) allocate too.
    held = _reachable(state)
    young = [thing for thing in young if id(thing) in held]
    # Per summary its dedupe key and its step-time point; nothing per rank or per communicator.
    assert len(young) <= 2 * PODS + 1, sorted({type(thing).__name__ for thing in young})


def _reachable(root: object) -> dict[int, object]:
    """The objects ``root`` holds, directly or not, by id (classes, modules and functions left out: they
    lead everywhere)."""
    seen: dict[int, object] = {}
    stack = [root]
    while stack:
        thing = stack.pop()
        if id(thing) in seen or isinstance(thing, (type, types.ModuleType, types.FunctionType)):
            continue
        seen[id(thing)] = thing
        stack.extend(gc.get_referents(thing))
    return seen
