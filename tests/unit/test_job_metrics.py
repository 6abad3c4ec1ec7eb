"""The operator's per-job series, read back through prometheus_client's own text exposition and parser
(what a Prometheus scrape sees), fed as the handlers and the collector feed them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rankwatch.operator.diagnosis.ingest.job_state import JobStore
from rankwatch.operator.diagnosis.report.job_metrics import JobMetrics, JobMetricsSettings
from rankwatch.protocol import CommWindow, Quantiles, RankWindow, WindowSummary

NOW = 1000.0
WALL = 1_700_000_000.0


def summary(job: str, pod: int, ranks: dict[int, float], window: int = 1, step_s: float = 0.02) -> WindowSummary:
    """One pod's window: each rank on one communicator with the given wait p50."""
    return WindowSummary(
        schema=1, namespace="team-a", job=job, pod=f"{job}-worker-{pod}", node=f"gpu-node-{pod}", replica_index=pod,
        expected_ranks=len(ranks), window=window, start_ns=window, end_ns=window + 1, dropped_summaries=0,
        ranks=[
            RankWindow(
                global_rank=rank, local_rank=rank % 8, pid=100 + rank, ring=f"{rank}.ring", alive=True, records=20,
                torn=0, overwritten=0, lost_updates=0, last_call_ns=1, step_time_s=step_s,
                comms=[
                    CommWindow(
                        comm_id="00000000000000a0", comm_rank=rank, comm_size=len(ranks), first_entered=1,
                        last_entered=10, first_completed=1, last_completed=10, in_flight=0, oldest_in_flight_s=None,
                        calls={"AllReduce": 10}, failed=0, wait=Quantiles(10, wait, wait, wait, wait), gap=None,
                        gpu=None,
                    )
                ],
            )
            for rank, wait in ranks.items()
        ],
    )  # fmt: skip


def scrape(metrics: JobMetrics) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """name -> {sorted labels: value}, as Prometheus would parse the exposition."""
    registry = CollectorRegistry()
    registry.register(metrics)
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def labels(**values: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"namespace": "team-a", **values}.items()))


def running_status(**extra) -> dict:
    return {
        "phase": "Running",
        "health": "Healthy",
        "conditions": [{"type": "Running", "status": "True"}, {"type": "Hung", "status": "False"}],
        **extra,
    }


def metrics_with(store: JobStore, **settings) -> JobMetrics:
    return JobMetrics(store, JobMetricsSettings(**settings), clock=lambda: NOW, wall_clock=lambda: WALL)


def test_phase_health_and_conditions_follow_the_jobs_status():
    metrics = metrics_with(JobStore())
    metrics.observe("team-a", "llama", running_status())
    series = scrape(metrics)
    phases = {dict(k)["phase"]: v for k, v in series["rankwatch_job_phase"].items()}
    assert phases == {"Pending": 0, "Suspended": 0, "Running": 1, "Succeeded": 0, "Failed": 0}
    assert series["rankwatch_job_health"][labels(trainingjob="llama", health="Healthy")] == 1
    assert series["rankwatch_job_condition"][labels(trainingjob="llama", condition="Hung")] == 0

    hung = running_status(
        health="Hung",
        conditions=[{"type": "Hung", "status": "True", "reason": "Hang"}],
        diagnosis={"active": True, "kind": "Hang", "ranks": [2]},
    )
    metrics.observe("team-a", "llama", hung)
    series = scrape(metrics)
    assert series["rankwatch_job_condition"][labels(trainingjob="llama", condition="Hung")] == 1
    assert series["rankwatch_job_health"][labels(trainingjob="llama", health="Hung")] == 1
    assert series["rankwatch_job_health"][labels(trainingjob="llama", health="Healthy")] == 0


def test_a_phase_the_code_does_not_know_is_still_exported():
    metrics = metrics_with(JobStore())
    metrics.observe("team-a", "llama", {"phase": "Restarting"})
    assert scrape(metrics)["rankwatch_job_phase"][labels(trainingjob="llama", phase="Restarting")] == 1


def test_detections_start_at_zero_and_count_per_job_and_kind():
    metrics = metrics_with(JobStore())
    metrics.observe("team-a", "llama", running_status())
    metrics.observe("team-a", "gpt", running_status())
    counts = scrape(metrics)["rankwatch_detections_total"]
    assert counts[labels(trainingjob="llama", kind="straggler")] == 0  # present before the first: increase() works
    metrics.detected("team-a", "llama", "straggler")
    metrics.detected("team-a", "llama", "straggler")
    metrics.detected("team-a", "gpt", "hang")
    counts = scrape(metrics)["rankwatch_detections_total"]
    assert counts[labels(trainingjob="llama", kind="straggler")] == 2
    assert counts[labels(trainingjob="gpt", kind="hang")] == 1
    assert counts[labels(trainingjob="gpt", kind="straggler")] == 0


def test_detector_runs_count_per_job_from_zero():
    metrics = metrics_with(JobStore())
    metrics.observe("team-a", "llama", running_status())
    metrics.observe("team-a", "gpt", running_status())
    assert scrape(metrics)["rankwatch_job_detector_runs_total"][labels(trainingjob="llama")] == 0
    for _ in range(3):
        metrics.judged("team-a", "llama")
    metrics.judged("team-a", "gpt")
    runs = scrape(metrics)["rankwatch_job_detector_runs_total"]
    assert (runs[labels(trainingjob="llama")], runs[labels(trainingjob="gpt")]) == (3, 1)
    metrics.forget("team-a", "llama")
    assert set(scrape(metrics)["rankwatch_job_detector_runs_total"]) == {labels(trainingjob="gpt")}


def test_step_wait_and_last_summary_from_the_collectors_state():
    store = JobStore()
    metrics = metrics_with(store)
    metrics.observe("team-a", "llama", running_status())
    state = store.get("team-a", "llama")
    state.add_summary(summary("llama", 0, {0: 0.004, 1: 0.005}, step_s=0.02), now=NOW - 3)
    state.add_summary(summary("llama", 1, {2: 0.0002, 3: 0.006}, step_s=0.03), now=NOW - 1)
    series = scrape(metrics)
    assert series["rankwatch_job_step_seconds"][labels(trainingjob="llama")] == 0.03  # median of the last points
    waits = {int(dict(k)["rank"]): v for k, v in series["rankwatch_rank_wait_seconds"].items()}
    assert waits == {0: 0.004, 1: 0.005, 2: 0.0002, 3: 0.006}
    last = series["rankwatch_collector_last_summary_timestamp_seconds"]
    assert last[labels(trainingjob="llama", pod="llama-worker-0")] == WALL - 3
    assert last[labels(trainingjob="llama", pod="llama-worker-1")] == WALL - 1

    metrics.observe_pods("team-a", "llama", ["llama-worker-1"])  # worker-0 was replaced: its old time is no alarm
    assert set(scrape(metrics)["rankwatch_collector_last_summary_timestamp_seconds"]) == {
        labels(trainingjob="llama", pod="llama-worker-1")
    }


def test_rank_series_are_bounded_keeping_suspects_and_both_extremes():
    store = JobStore()
    metrics = metrics_with(store, rank_series_per_job=6)
    waits = {rank: 0.001 + rank * 1e-5 for rank in range(1024)}
    waits[700] = 0.00001  # the straggler waits least
    metrics.observe("team-a", "big", running_status(diagnosis={"active": True, "kind": "Straggler", "ranks": [512]}))
    state = store.get("team-a", "big")
    for pod in range(128):
        state.add_summary(summary("big", pod, {r: waits[r] for r in range(pod * 8, pod * 8 + 8)}), now=NOW)
    ranks = {int(dict(k)["rank"]) for k in scrape(metrics)["rankwatch_rank_wait_seconds"]}
    assert len(ranks) == 6
    assert {512, 700, 0, 1023, 1022} <= ranks  # the suspect, the lowest waits and the highest


def test_a_deleted_jobs_series_go():
    store = JobStore()
    metrics = metrics_with(store)
    metrics.observe("team-a", "llama", running_status())
    store.get("team-a", "llama").add_summary(summary("llama", 0, {0: 0.001}), now=NOW)
    metrics.observe("team-a", "gpt", running_status())
    metrics.forget("team-a", "llama")
    store.drop("team-a", "llama")
    for name, samples in scrape(metrics).items():
        assert all(dict(key).get("trainingjob") != "llama" for key in samples), name
    assert labels(trainingjob="gpt", phase="Running") in scrape(metrics)["rankwatch_job_phase"]


def test_cordoned_nodes_count_real_cordons_only():
    metrics = metrics_with(JobStore())
    cordoned = {"rankwatch.io/cordoned-by": "rankwatch"}
    metrics.observe_node("gpu-node-1", cordoned)
    metrics.observe_node("gpu-node-2", {**cordoned, "rankwatch.io/dry-run": "true"})
    metrics.observe_node("gpu-node-3", {"rankwatch.io/dry-run": "true"})
    assert scrape(metrics)["rankwatch_cordoned_nodes"][()] == 1
    metrics.observe_node("gpu-node-1", {"rankwatch.io/uncordoned-at": "2026-01-01T00:00:00Z"})
    assert scrape(metrics)["rankwatch_cordoned_nodes"][()] == 0


def test_a_replica_that_does_not_lead_exports_none_of_these_series():
    leading = [False]
    metrics = JobMetrics(JobStore(), leading=lambda: leading[0])
    metrics.observe("team-a", "llama", running_status())
    assert scrape(metrics) == {}
    leading[0] = True
    assert {"rankwatch_job_phase", "rankwatch_cordoned_nodes"} <= set(scrape(metrics))
