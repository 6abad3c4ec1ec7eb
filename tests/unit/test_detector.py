"""The detector on job states built from window summaries (the collector's input), with a fake clock."""

from __future__ import annotations

import random

from rankwatch.analysis.topology import Layout
from rankwatch.operator.diagnosis.detect.detector import (
    EVIDENCE_WINDOWS,
    Thresholds,
    detect,
    host_starved,
    step_time_up,
    wait_outliers,
)
from rankwatch.operator.diagnosis.ingest.job_state import JobState
from rankwatch.protocol import CommWindow, Quantiles, RankScheduling, RankWindow, StallReport, WindowSummary

WINDOW = 5.0
THRESHOLDS = Thresholds(sensitivity_s=60.0, window_s=WINDOW)
LAYOUT = Layout(tp=4, pp=1, world_size=8)  # TP groups {0..3} and {4..7}; DP groups {r, r+4}


def comm_ids(rank: int) -> dict[str, tuple[int, int]]:
    """communicator id -> (rank in it, size) for rank of LAYOUT: its TP group and its DP group."""
    tp, dp, _ = LAYOUT.coords(rank)
    return {f"{0xA0 + dp:016x}": (tp, 4), f"{0xB0 + tp:016x}": (dp, 2)}


def window(
    state: JobState,
    now: float,
    number: int,
    waits: dict[int, float],
    completed: int,
    in_flight_s: float | None = None,
    step_s: float = 0.02,
    run_delay_s: dict[int, float] | None = None,
    gpu_timed: bool = False,
) -> None:
    """One summary per pod (4 ranks each) at time ``now``; ``run_delay_s``: seconds each rank waited for a
    CPU in the window. ``gpu_timed``: ``waits`` are GPU start-to-end and the host calls return at once
    (an asynchronous GPU), as the sidecar summarises GPU-timed rings."""
    for pod in range(2):
        ranks = []
        for rank in range(pod * 4, pod * 4 + 4):
            comms = [
                CommWindow(
                    comm_id=comm,
                    comm_rank=comm_rank,
                    comm_size=size,
                    first_entered=completed - 9,
                    last_entered=completed + (1 if in_flight_s else 0),
                    first_completed=completed - 9,
                    last_completed=completed,
                    in_flight=1 if in_flight_s else 0,
                    oldest_in_flight_s=in_flight_s,
                    calls={"AllReduce": 10},
                    failed=0,
                    wait=Quantiles(10, 2e-6, 2e-6, 3e-6, 5e-6)
                    if gpu_timed
                    else Quantiles(10, waits[rank], waits[rank], waits[rank], 0.01),
                    gap=None,
                    gpu=Quantiles(10, waits[rank], waits[rank], waits[rank], 0.01) if gpu_timed else None,
                )
                for comm, (comm_rank, size) in comm_ids(rank).items()
            ]
            ranks.append(
                RankWindow(
                    global_rank=rank,
                    local_rank=rank % 4,
                    pid=100 + rank,
                    ring=f"{rank}.ring",
                    alive=True,
                    records=20,
                    torn=0,
                    overwritten=0,
                    lost_updates=0,
                    last_call_ns=1,
                    step_time_s=step_s,
                    comms=comms,
                    scheduling=RankScheduling(0.5, run_delay_s[rank], 10) if run_delay_s else None,
                )
            )
        summary = WindowSummary(
            schema=1, namespace="ns", job="job", pod=f"job-worker-{pod}", node=f"gpu-node-{pod}", replica_index=pod,
            expected_ranks=4, window=number, start_ns=int(number * WINDOW * 1e9),
            end_ns=int((number + 1) * WINDOW * 1e9), dropped_summaries=0, ranks=ranks,
        )  # fmt: skip
        state.add_summary(summary, now=now)


def jittery_waits(generator: random.Random, slow: int | None = None) -> dict[int, float]:
    waits = {rank: 0.0008 * generator.uniform(0.5, 1.6) for rank in range(8)}
    if slow is not None:
        waits[slow] = 0.00005 * generator.uniform(0.8, 1.2)  # a straggler arrives last and waits least
    return waits


def run(windows: int, slow: int | None = None, seed: int = 1, **kwargs) -> tuple[JobState, float]:
    generator, state = random.Random(seed), JobState("ns", "job")
    for number in range(windows):
        window(state, number * WINDOW, number, jittery_waits(generator, slow), completed=10 * (number + 1), **kwargs)
    return state, (windows - 1) * WINDOW


def test_healthy_job_with_jitter_raises_nothing_over_many_seeds():
    for seed in range(50):
        state, now = run(30, seed=seed)
        assert detect(state, THRESHOLDS, LAYOUT, now) == [], f"seed {seed}"


def test_rank_waiting_far_less_than_its_tp_peers_is_the_straggler():
    state, now = run(6, slow=5)
    (suspicion,) = detect(state, THRESHOLDS, LAYOUT, now)
    assert suspicion.kind == "straggler" and suspicion.ranks == [5]
    assert "rank 5" in suspicion.summary


def test_straggler_on_an_asynchronous_gpu_is_found_from_gpu_times_when_host_waits_are_nil():
    # every host call returns at once (2 µs for all): the GPU's start-to-end is where its peers wait
    state, now = run(6, slow=5, gpu_timed=True)
    (suspicion,) = detect(state, THRESHOLDS, LAYOUT, now)
    assert suspicion.kind == "straggler" and suspicion.ranks == [5]
    for seed in range(20):
        state, now = run(30, seed=seed, gpu_timed=True)
        assert detect(state, THRESHOLDS, LAYOUT, now) == [], f"seed {seed}"


def test_straggler_needs_several_windows_of_evidence():
    state, now = run(1, slow=5)
    assert wait_outliers(state, LAYOUT, THRESHOLDS, now) is None


def test_communicator_not_fully_reported_is_not_compared():
    state, now = run(6, slow=5)
    for comm in ("00000000000000a1",):
        del state.ranks[4].comms[comm]  # one member of the slow TP group has not reported it yet
    assert wait_outliers(state, LAYOUT, THRESHOLDS, now) is None


def test_a_member_reporting_a_communicator_late_joins_its_peer_group():
    """The peer groups are kept with the job's state between passes: a communicator a member reports
    later makes its group whole again."""
    generator, state = random.Random(1), JobState("ns", "job")
    for number in range(6):
        window(state, number * WINDOW, number, jittery_waits(generator, 5), completed=10 * (number + 1))
        if number < 3:
            del state.ranks[4].comms["00000000000000a1"]  # rank 4 has not reported its TP group yet
            assert wait_outliers(state, LAYOUT, THRESHOLDS, number * WINDOW) is None
    suspicion = wait_outliers(state, LAYOUT, THRESHOLDS, 5 * WINDOW)
    assert suspicion is not None and suspicion.ranks == [5]


def test_call_in_flight_longer_than_the_sensitivity_is_a_hang():
    state, now = run(3, in_flight_s=61.0)
    (suspicion,) = detect(state, THRESHOLDS, LAYOUT, now)
    assert suspicion.kind == "hang" and suspicion.evidence["source"] == "in_flight"


def test_no_progress_for_the_sensitivity_is_a_hang_even_without_in_flight_calls():
    state, _ = run(3)
    last = state.progress_at
    for number in range(3, 20):  # windows keep coming, nothing completes
        window(state, number * WINDOW, number, jittery_waits(random.Random(number)), completed=30)
    now = 19 * WINDOW
    assert now - last >= THRESHOLDS.sensitivity_s
    (suspicion,) = detect(state, THRESHOLDS, LAYOUT, now)
    assert suspicion.kind == "hang" and suspicion.evidence["source"] == "no_progress"


def rank_5_stalled() -> StallReport:
    """What rank 5's sidecar sends once it made no NCCL call for the sensitivity (60 s)."""
    return StallReport(
        schema=1, namespace="ns", job="job", pod="job-worker-1", node="gpu-node-1", replica_index=1, detected_ns=1,
        sensitivity_s=60.0, stalled_ranks=[5], summary="rank 5 made no NCCL call for 60 s", megatrace_dir=None,
        positions=[],
    )  # fmt: skip


def test_stall_report_is_a_hang_until_the_stalled_rank_moves():
    state, now = run(3)
    report = rank_5_stalled()
    state.add_stall(report, now=now)
    (suspicion,) = detect(state, THRESHOLDS, LAYOUT, now + 1)
    assert suspicion.kind == "hang" and suspicion.ranks == [5]
    window(state, now + 2, 3, jittery_waits(random.Random(3)), completed=40)  # rank 5 completed more
    assert [s.kind for s in detect(state, THRESHOLDS, LAYOUT, now + 3)] == []


def test_step_time_up_against_the_jobs_own_baseline():
    generator, state = random.Random(3), JobState("ns", "job")
    for number in range(20):
        step = 0.020 * generator.uniform(0.97, 1.03) * (1.25 if number >= 15 else 1.0)
        window(state, number * WINDOW, number, jittery_waits(generator), completed=10 * (number + 1), step_s=step)
    kinds = [s.kind for s in detect(state, THRESHOLDS, LAYOUT, 19 * WINDOW)]
    assert kinds == ["fail_slow"]


def test_a_thousand_calm_ranks_raise_no_suspicion():
    """Its speed (milliseconds a window) is measured by ``bench/operator_cpu.py``, not by a wall clock here."""
    layout = Layout(tp=8, pp=1, world_size=1024)
    state = JobState("ns", "big")
    generator = random.Random(0)
    for number in range(4):
        for pod in range(128):
            ranks = []
            for rank in range(pod * 8, pod * 8 + 8):
                tp, dp, _ = layout.coords(rank)
                comms = [
                    CommWindow(comm_id=f"{0xA000 + dp:016x}", comm_rank=tp, comm_size=8, first_entered=1,
                               last_entered=number + 1, first_completed=1, last_completed=number + 1, in_flight=0,
                               oldest_in_flight_s=None, calls={"AllReduce": 10}, failed=0,
                               wait=Quantiles(10, *(4 * [0.001 * generator.uniform(0.5, 1.5)])), gap=None, gpu=None)
                ]  # fmt: skip
                ranks.append(RankWindow(rank, tp, rank, "r", True, 10, 0, 0, 0, 1, 0.02, comms))
            state.add_summary(
                WindowSummary(1, "ns", "big", f"p{pod}", f"n{pod}", pod, 8, number, number, number + 1, 0, ranks),
                now=number * WINDOW,
            )
    assert detect(state, THRESHOLDS, layout, 3 * WINDOW) == []


def starved_run(waits_of_group_1: float, delays: dict[int, float], seed: int = 1) -> tuple[JobState, float]:
    """6 windows; TP group {4..7} waits ``waits_of_group_1`` per collective, group {0..3} jitters as usual."""
    generator, state = random.Random(seed), JobState("ns", "job")
    for number in range(6):
        waits = jittery_waits(generator)
        waits.update({rank: waits_of_group_1 * generator.uniform(0.9, 1.1) for rank in range(4, 8)})
        window(state, number * WINDOW, number, waits, completed=10 * (number + 1), run_delay_s=delays)
    return state, 5 * WINDOW


def test_rank_starved_of_cpu_holding_back_its_group_is_a_suspected_straggler():
    # rank 5 waits 4 s of each 5 s window for a CPU; its TP group waits 6 ms per collective, the other 0.8 ms
    state, now = starved_run(0.006, {**{rank: 0.3 for rank in range(8)}, 5: 4.0})
    (suspicion,) = detect(state, THRESHOLDS, LAYOUT, now)
    assert suspicion.kind == "straggler" and suspicion.ranks == [5]
    assert suspicion.evidence["source"] == "host_starved"
    assert suspicion.evidence["ranks"]["5"]["run_delay_ms_per_s"] == 800.0
    assert "rank 5's process waits 800 ms per second for a CPU against 60 ms/s" in suspicion.summary


def test_a_busy_machine_or_a_starved_rank_that_holds_nobody_back_raises_nothing():
    busy = {rank: 2.0 for rank in range(8)}  # every rank waits alike: the machine, not one host
    state, now = starved_run(0.006, busy)
    assert detect(state, THRESHOLDS, LAYOUT, now) == []
    state, now = starved_run(0.0008, {**{rank: 0.3 for rank in range(8)}, 5: 4.0})
    assert detect(state, THRESHOLDS, LAYOUT, now) == [], "its group is not held back"


def test_a_job_whose_sidecars_went_silent_keeps_its_hang_detection():
    """No summary for longer than the slowness checks look back (``EVIDENCE_WINDOWS``): those are skipped,
    and they would have found nothing; the hang checks still run: a stall report, a call in flight and
    no progress are each still a hang."""
    silence = EVIDENCE_WINDOWS * WINDOW + 1.0

    state, now = run(6, slow=5)
    assert [s.kind for s in detect(state, THRESHOLDS, LAYOUT, now)] == ["straggler"]
    later = now + silence
    assert wait_outliers(state, LAYOUT, THRESHOLDS, later) is None, "its evidence aged out anyway"
    assert host_starved(state, LAYOUT, THRESHOLDS, later) is None and step_time_up(state, THRESHOLDS, later) is None
    assert detect(state, THRESHOLDS, LAYOUT, later) == []

    report = rank_5_stalled()
    state.add_stall(report, now=now)
    (suspicion,) = detect(state, THRESHOLDS, LAYOUT, now + silence)
    assert suspicion.kind == "hang" and suspicion.ranks == [5]

    state, now = run(3, in_flight_s=61.0)
    (suspicion,) = detect(state, THRESHOLDS, LAYOUT, now + silence)
    assert suspicion.kind == "hang" and suspicion.evidence["source"] == "in_flight"

    state, _ = run(3)
    for number in range(3, 12):  # windows keep coming, nothing completes; then the sidecars go quiet
        window(state, number * WINDOW, number, jittery_waits(random.Random(number)), completed=30)
    now = 11 * WINDOW + silence
    assert now - state.progress_at >= THRESHOLDS.sensitivity_s
    (suspicion,) = detect(state, THRESHOLDS, LAYOUT, now)
    assert suspicion.kind == "hang" and suspicion.evidence["source"] == "no_progress"
