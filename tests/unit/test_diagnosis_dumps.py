"""Which sidecars a diagnosis asks, and for how many records: the ones that matter, within the budget."""

from __future__ import annotations

from rankwatch.analysis.topology import Layout
from rankwatch.model.finding import FindingKind
from rankwatch.operator.diagnosis.detect.detector import suspected
from rankwatch.operator.diagnosis.diagnose.diagnose import (
    EVERY_POD_UP_TO,
    MAX_PODS,
    MIN_RECORDS_PER_RING,
    SidecarPod,
    pods_to_ask,
    records_limit,
)
from rankwatch.operator.diagnosis.ingest.job_state import CommState, JobState, RankState

PODS, PER_POD = 64, 8
LAYOUT = Layout(tp=8, pp=1, world_size=PODS * PER_POD)  # TP = one pod; DP groups across pods


def pod_of(rank: int) -> str:
    return f"big-worker-{rank // PER_POD}"


def job(entered: dict[int, int] | None = None, in_flight: dict[int, float] | None = None) -> JobState:
    """Every rank on its TP and DP communicator at sequence 100, unless ``entered`` says otherwise."""
    state = JobState("ns", "big")
    entered, in_flight = entered or {}, in_flight or {}
    for rank in range(LAYOUT.world_size):
        tp, dp, _ = LAYOUT.coords(rank)
        seq = entered.get(rank, 100)
        tp_comm = CommState(8, last_entered=seq, last_completed=seq - 1)
        tp_comm.in_flight, tp_comm.oldest_in_flight_s = (1, in_flight[rank]) if rank in in_flight else (0, None)
        comms = {f"tp-{dp}": tp_comm, f"dp-{tp}": CommState(PODS, last_entered=seq, last_completed=seq - 1)}
        state.ranks[rank] = RankState(rank, pod_of(rank), f"node-{rank // PER_POD}", comms=comms)
        state.ranks[rank].records = (2000,)
    return state


PODS_LIST = [SidecarPod(f"big-worker-{index}", f"node-{index}", f"http://10.0.0.{index}:9400") for index in range(PODS)]


def test_a_small_job_asks_every_pod():
    pods = PODS_LIST[:EVERY_POD_UP_TO]
    hang = suspected(FindingKind.HANG, [], "no progress")
    assert pods_to_ask(job(), hang, LAYOUT, pods) == sorted(pod.name for pod in pods)


def test_a_hang_in_a_large_job_asks_the_rank_behind_and_a_few_that_wait_for_it():
    behind = 300  # pod 37, never entered sequence 100 of its communicators
    chosen = pods_to_ask(job(entered={behind: 99}), suspected(FindingKind.HANG, [], "stalled"), LAYOUT, PODS_LIST)
    assert pod_of(behind) in chosen and len(chosen) <= 4, chosen


def test_a_collective_stuck_on_every_member_asks_its_members():
    stuck = {rank: 120.0 for rank in range(16, 24)}  # every member of TP group 2 inside it for two minutes
    chosen = pods_to_ask(job(in_flight=stuck), suspected(FindingKind.HANG, [], "stuck"), LAYOUT, PODS_LIST)
    assert pod_of(16) in chosen and len(chosen) <= 2 * 1 + 1, chosen


def test_a_straggler_asks_its_tensor_parallel_peers_and_a_slowdown_a_spread_of_the_job():
    assert pods_to_ask(job(), suspected(FindingKind.STRAGGLER, [77], "late"), LAYOUT, PODS_LIST) == [pod_of(77)]
    slowdown = job()
    slowdown.ranks[200].step_time_s = 0.05
    chosen = pods_to_ask(slowdown, suspected(FindingKind.FAIL_SLOW, [], "slower"), LAYOUT, PODS_LIST)
    assert pod_of(200) in chosen and 8 <= len(chosen) <= MAX_PODS and len(chosen) < PODS


def test_a_straggler_without_tensor_parallel_peers_asks_the_members_of_its_communicators():
    # TP 1: the straggler's only peers are its data-parallel ones, on other pods; the analysis compares a
    # collective only when all its members' records are in (half a communicator named nobody, 2026-11-26)
    state, layout = JobState("ns", "dp"), Layout(tp=1, pp=1, world_size=32 * PER_POD)
    for rank in range(layout.world_size):
        comms = {"world": CommState(layout.world_size, last_entered=100, last_completed=99)}
        state.ranks[rank] = RankState(rank, pod_of(rank), f"node-{rank // PER_POD}", comms=comms)
    pods = PODS_LIST[:32]
    chosen = pods_to_ask(state, suspected(FindingKind.STRAGGLER, [77], "late"), layout, pods)
    assert chosen == sorted(pod.name for pod in pods)
    small = pods_to_ask(job(), suspected(FindingKind.STRAGGLER, [5], "late"), LAYOUT, PODS_LIST[:2])
    assert small == [pod.name for pod in PODS_LIST[:2]]  # a small job: every pod, as for every suspicion


def test_records_per_ring_shrink_with_the_job_to_stay_within_the_dump_budget():
    state = job()
    few = records_limit(state, [pod_of(0)], 5.0, 96 << 20)
    many = records_limit(state, sorted({pod_of(r) for r in state.ranks}), 5.0, 96 << 20)
    assert few == 12_000  # 30 s of 2,000 records per 5 s window
    assert MIN_RECORDS_PER_RING <= many < few and many * 2 * 128 * len(state.ranks) <= 96 << 20
