"""A job's in-memory state stays within the limits of its spec, whatever its sidecars (or whoever holds
its token) send; what does not fit is counted on /metrics."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import CollectorRegistry

from rankwatch.operator.diagnosis.ingest.job_state import JobStore, StateLimits
from rankwatch.operator.diagnosis.metrics import DiagnosisMetrics
from rankwatch.protocol import CommWindow, Quantiles, RankWindow, WindowSummary


def comm(comm_id: int) -> CommWindow:
    return CommWindow(
        comm_id=f"{comm_id:016x}", comm_rank=0, comm_size=8, first_entered=1, last_entered=2, first_completed=1,
        last_completed=2, in_flight=0, oldest_in_flight_s=None, calls={"AllReduce": 2}, failed=0,
        wait=Quantiles(2, 0.001, 0.001, 0.001, 0.001), gap=None, gpu=None,
    )  # fmt: skip


def window(rank: int, comms: int = 1) -> RankWindow:
    return RankWindow(
        global_rank=rank, local_rank=0, pid=1, ring="r.ring", alive=True, records=2, torn=0, overwritten=0,
        lost_updates=0, last_call_ns=1, step_time_s=0.1, comms=[comm(c) for c in range(comms)],
    )  # fmt: skip


def summary(pod: str, ranks: list[RankWindow], window_index: int = 1) -> WindowSummary:
    return WindowSummary(
        schema=1, namespace="team-a", job="llama", pod=pod, node="node", replica_index=0, expected_ranks=8,
        window=window_index, start_ns=window_index, end_ns=window_index + 1, dropped_summaries=0, ranks=ranks,
    )  # fmt: skip


REGISTRY = CollectorRegistry()
METRICS = DiagnosisMetrics(REGISTRY)


def dropped(what: str) -> float:
    return REGISTRY.get_sample_value("rankwatch_collector_dropped_total", {"what": what}) or 0.0


def test_pods_ranks_and_communicators_are_capped_and_counted():
    limits = StateLimits(ranks=16, pods=4, comms_per_rank=3)
    state = JobStore(on_drop=METRICS.dropped).get("team-a", "llama", limits)
    before = {what: dropped(what) for what in ("pod", "rank", "comm")}
    for index in range(10):  # ten pods, each claiming ranks far beyond the world size
        state.add_summary(summary(f"pod-{index}", [window(index), window(1000 + index), window(10**12)]), now=1.0)
    state.add_summary(summary("pod-0", [window(0, comms=50)], 2), now=2.0)
    assert len(state.pods) == 4 and set(state.ranks) == {0, 1, 2, 3}
    assert len(state.ranks[0].comms) == 3
    assert dropped("pod") - before["pod"] == 6
    assert dropped("rank") - before["rank"] == 8  # the two out-of-range ranks of the four pods kept
    assert dropped("comm") - before["comm"] == 47
    assert state.dropped == 6 + 8 + 47


def test_twenty_large_summaries_stay_within_a_small_jobs_limits():
    """The attack that took the operator past 1 GiB: 20 summaries of 4,096 ranks x 64 communicators
    each, sent with a 16-rank job's token. The state keeps 16 ranks, whatever arrives."""
    state = JobStore().get("team-a", "llama", StateLimits.for_job(world_size=16, replicas=2))
    big = [window(rank, comms=64) for rank in range(4096)]
    for index in range(20):
        state.add_summary(summary(f"pod-{index % 2}", big, index + 1), now=float(index))
    assert len(state.ranks) == 16 and len(state.pods) == 2
    assert sum(len(rank.comms) for rank in state.ranks.values()) <= 16 * StateLimits().comms_per_rank


def test_a_later_attempt_keeps_the_jobs_limits():
    store = JobStore()
    limits = StateLimits(ranks=8, pods=2, comms_per_rank=4)
    store.get("team-a", "llama", limits)
    store.new_attempt("team-a", "llama", {"pod-0"})
    state = store.get("team-a", "llama")
    assert state.limits == limits
    state.add_summary(summary("pod-9", [replace(window(9), global_rank=9)]), now=1.0)
    assert state.ranks == {}
