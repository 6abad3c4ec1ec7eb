"""`rankwatch analyze` on real traces of the asynchronous stand-in device (NCCL calls return at once, the
collectives run behind the host on the device's streams), with GPU timing and with host call times only."""

from __future__ import annotations

import time

import numpy as np

from rankwatch.analysis.analyze import analyze
from rankwatch.analysis.load import load_path
from rankwatch.analysis.ring import HEADER_SIZE, RECORD_DTYPE, Flag, Op, RingReader, State, peek_header
from rankwatch.sidecar.ring_tail import RingTail
from rankwatch.standins.simulate import Faults, Simulation, run


def simulate(tmp_path, gpu_timing: bool, compute_us: int = 1000, **kwargs) -> dict:
    faults = kwargs.pop("faults", Faults())
    simulation = Simulation(
        compute_us=compute_us, ranks_per_node=4, device="async", gpu_timing=gpu_timing, faults=faults, **kwargs
    )
    run(simulation, tmp_path)
    return analyze(load_path(tmp_path))


def test_gpu_timed_hang_names_the_rank_that_never_called_once(tmp_path):
    # the peers' hosts ran ahead and blocked in a synchronisation; their GPUs wait in the collective
    document = simulate(tmp_path, True, world_size=8, tp=4, steps=60, faults=Faults(hang_rank=2, hang_at=300))
    [hang] = document["findings"]
    assert (hang["kind"], hang["ranks"], hang["nodes"]) == ("hang", [2], ["sim-node-0"])
    assert hang["evidence"]["waiting_ranks"] == [0, 1, 3, 4, 5, 6, 7]
    assert hang["confidence"] >= 0.9


def test_gpu_timed_device_stop_names_the_rank_whose_gpu_never_started_the_collective(tmp_path):
    document = simulate(
        tmp_path, True, world_size=8, tp=4, steps=60, faults=Faults(device_stop_rank=6, device_stop_at_kernel=300)
    )
    [hang] = document["findings"]
    assert (hang["kind"], hang["ranks"], hang["nodes"]) == ("hang", [6], ["sim-node-1"])
    assert "never started while its peers' did" in hang["summary"]


def test_gpu_timed_stuck_collective_names_the_rank_whose_gpu_never_started_it(tmp_path):
    # rank 6's call 300 was enqueued (the host returned) but its GPU never started it, while its TP
    # peers' GPUs did and wait inside: rank 6 alone, one finding
    document = simulate(tmp_path, True, world_size=8, tp=4, steps=60, faults=Faults(stuck_rank=6, stuck_at=300))
    [hang] = document["findings"]
    assert (hang["kind"], hang["ranks"], hang["nodes"]) == ("hang", [6], ["sim-node-1"]), hang
    assert hang["confidence"] >= 0.9


def test_gpu_timed_collective_that_never_ends_is_one_finding_on_its_group_not_the_waiters(tmp_path):
    # an operation that starts on every member's GPU and never ends: the members look alike and are
    # named, the other node's ranks queued behind them are not, nor are the calls queued behind it
    document = simulate(
        tmp_path, True, world_size=8, tp=4, steps=60, faults=Faults(never_ends_rank=6, never_ends_at=300)
    )
    [hang] = document["findings"]
    assert hang["kind"] == "hang" and hang["evidence"]["stuck"] is True
    assert 6 in hang["ranks"] and set(hang["ranks"]) <= {4, 5, 6, 7} and hang["nodes"] == ["sim-node-1"]


def test_gpu_timed_straggler_is_named_and_a_healthy_run_is_healthy(tmp_path):
    from rankwatch.analysis.analyze import NOT_LOCALISABLE

    slow = simulate(
        tmp_path / "slow", True, 3000, world_size=8, tp=4, steps=40, faults=Faults(slow_rank=5, slowdown=0.3)
    )
    named = [(f["kind"], f["ranks"]) for f in slow["findings"]]
    # a machine loaded mid-run may add the job's own slowdown (fail_slow), behind the same rank or nobody
    # (then first when the load made it larger than the straggler's): the first to name a rank is rank 5's
    first_named = next(((kind, ranks) for kind, ranks in named if ranks), None)
    assert first_named == ("straggler", [5]) and all(set(ranks) <= {5} for _, ranks in named), slow["findings"]
    healthy = simulate(tmp_path / "healthy", True, world_size=8, tp=4, steps=40)
    assert healthy["healthy"] is True and healthy["findings"] == [], healthy["findings"]
    assert NOT_LOCALISABLE not in slow["problems"] + healthy["problems"]


def test_host_times_only_name_the_rank_that_never_called(tmp_path):
    # without GPU times no call stays in flight (each returned at once): who stopped calling shows
    document = simulate(tmp_path, False, world_size=8, tp=4, steps=60, faults=Faults(hang_rank=2, hang_at=300))
    [hang] = document["findings"]
    assert (hang["kind"], hang["ranks"], hang["nodes"]) == ("hang", [2], ["sim-node-0"])


def test_host_times_only_never_blame_a_wrong_rank_for_a_straggler(tmp_path):
    # host call times of a run-ahead job cannot single out a slow GPU: nobody else may be named
    document = simulate(tmp_path, False, 3000, world_size=8, tp=4, steps=40, faults=Faults(slow_rank=5, slowdown=0.3))
    for finding in document["findings"]:
        assert finding["ranks"] in ([], [5]), document["findings"]
    assert any("not localisable from call times; enable GPU timing" in p for p in document["problems"])


def _ring_of(directory, rank: int):
    return next(path for path in directory.glob("*.ring") if peek_header(path)[0] == rank)


def _slots(path) -> np.memmap:
    """The ring file's records, writable in place (what the library wrote, changed where a test says)."""
    capacity = RingReader(path).capacity
    return np.memmap(path, RECORD_DTYPE, mode="r+", offset=HEADER_SIZE, shape=(capacity,))


def _gpu_done_collectives(slots: np.ndarray) -> np.ndarray:
    timed = (slots["flags"] & Flag.GPU_TIMED) != 0
    collective = (slots["op"] > Op.NONE) & (slots["op"] < Op.SEND)
    return np.flatnonzero(timed & collective & (slots["state"] == State.GPU_DONE))


def test_gpu_timed_calls_whose_end_came_before_their_return_or_never_came_are_not_in_flight(tmp_path):
    # A real run, healthy. The library once left calls whose GPU work ran before the host call returned
    # in state RETURNED with their GPU end written (its poller wrote the end first; seen on the Python
    # trainer, 2026-11-26): read as in flight for ever, one such call 8,000 calls back made the job look
    # hung on healthy peers "that never entered" it. An end may also never be read at all. Both written
    # here into the real rings, far from the end of the run: the calls after them on the same stream ran.
    simulate(tmp_path, True, world_size=8, tp=4, steps=40)
    raced, lost = _slots(_ring_of(tmp_path, 3)), _slots(_ring_of(tmp_path, 5))
    early_raced, early_lost = _gpu_done_collectives(raced)[100], _gpu_done_collectives(lost)[150]
    raced["state"][early_raced] = State.RETURNED
    lost["state"][early_lost], lost["gpu_start_ns"][early_lost], lost["gpu_end_ns"][early_lost] = State.RETURNED, 0, 0
    raced.flush(), lost.flush()

    document = analyze(load_path(tmp_path))
    assert [f for f in document["findings"] if f["kind"] == "hang"] == [], document["findings"]
    for path, slots, row in ((_ring_of(tmp_path, 3), raced, early_raced), (_ring_of(tmp_path, 5), lost, early_lost)):
        tail = RingTail(path)  # the sidecar's reading agrees
        tail.poll()
        assert slots["stamp"][row] not in tail.pending["stamp"], tail.pending


def test_a_call_whose_gpu_end_was_lost_is_not_a_hang_when_its_peers_left_the_collective(tmp_path):
    # the last collective on its stream: no later call shows it over, its peers' records do
    simulate(tmp_path, True, world_size=8, tp=4, steps=40)
    slots = _slots(_ring_of(tmp_path, 3))
    done = _gpu_done_collectives(slots)
    started = slots["gpu_start_ns"] > 0

    def nothing_started_after(index: int) -> bool:
        later = slots["stamp"] > slots["stamp"][index]
        return not (later & (slots["stream"] == slots["stream"][index]) & started).any()

    # the run may end with a later call on that stream already started (a send, a compute event): take the
    # last GPU-done collective that nothing on its stream started after
    last_on_stream = next(int(i) for i in done[np.argsort(-slots["stamp"][done])] if nothing_started_after(int(i)))
    slots["state"][last_on_stream], slots["gpu_end_ns"][last_on_stream] = State.RETURNED, 0
    slots.flush()
    trace = load_path(tmp_path)
    calls = trace.calls
    mine = (
        (calls["rank"] == 3)
        & (calls["seq"] == slots["seq"][last_on_stream])
        & (calls["comm"] == slots["comm_id"][last_on_stream])
    )
    assert calls["t_return"][mine].tolist() == [0]  # read as in flight: nothing on its GPU says otherwise
    document = analyze(trace)
    assert [f for f in document["findings"] if f["kind"] == "hang"] == [], document["findings"]


def test_megatrace_logs_of_a_run_ahead_job_name_the_hang_and_no_straggler(tmp_path):
    # Megatrace logs carry call times only. A host running ahead of its GPU reaches a call early or late
    # for reasons of its own: launch order (rank 0 behind its TP partner by a fraction of a millisecond
    # at every collective), the last pipeline stage's host blocking on the loss (behind the world by tens
    # of ms). Neither is who the GPUs wait for: the hang is named, nobody else, and the report says why.
    from rankwatch.analysis.megatrace import read_logs, write_logs

    for name, layout, faults, expected in (
        ("hang", dict(world_size=8, tp=2, pp=2, steps=50), Faults(hang_rank=5, hang_at=30), [("hang", [5])]),
        # a pipeline of 8: the culprit's last call is a send, whose peer the format does not name
        ("pipeline", dict(world_size=8, tp=1, pp=8, steps=30), Faults(hang_rank=6, hang_at=141), [("hang", [6])]),
        ("healthy", dict(world_size=8, tp=2, pp=4, steps=20), Faults(), []),
    ):
        simulation = Simulation(**layout, compute_us=1000, ranks_per_node=4, device="async", gpu_timing=True,
                                faults=faults)  # fmt: skip
        run(simulation, tmp_path / name / "rings")
        write_logs(load_path(tmp_path / name / "rings"), tmp_path / name / "megatrace")
        for ranks_per_node in (None, 4):  # host clocks taken as aligned, and offsets removed per node
            trace = read_logs(tmp_path / name / "megatrace")
            trace.ranks_per_node = ranks_per_node
            trace.observed_until_ns = time.time_ns()  # seen stopped when the logs were collected
            document = analyze(trace)
            assert [(f["kind"], f["ranks"]) for f in document["findings"]] == expected, document["findings"]
    # the healthy run's last-stage host, behind the world by tens of ms: set aside, and said why
    assert any("not localisable from call times" in p for p in document["problems"]), document["problems"]
