"""The cause of a finding: decided by the figures, stated with them, never guessed. The straggler is a
real one (a `rankwatch simulate` run analysed); the hosts' figures are what the collector would hold."""

from __future__ import annotations

import dataclasses

import pytest

from rankwatch.analysis.analyze import analyze_trace, summary_text
from rankwatch.analysis.cause import HostLoads, RankHostLoad, attribute
from rankwatch.analysis.findings import AnalysisReport, Cause, Finding
from rankwatch.analysis.load import load_path
from rankwatch.standins.simulate import Faults, Simulation, run


@pytest.fixture(scope="module")
def straggler(tmp_path_factory) -> Finding:
    directory = tmp_path_factory.mktemp("straggler")
    # the synchronous device without GPU timing: a straggler the traces name but whose cause they cannot tell
    run(Simulation(device="sync", gpu_timing=False, world_size=8, tp=4, steps=12, compute_us=3000, ranks_per_node=4,
                   faults=Faults(slow_rank=6, slowdown=0.5)), directory)  # fmt: skip
    report = analyze_trace(load_path(directory))
    [finding] = report.findings
    assert finding.ranks == [6]
    return finding


def loads(delays_ms: dict[int, float], pressure: dict[str, float] | None = None) -> HostLoads:
    """Run-queue delay per second of each rank (ranks 0-3 on sim-node-0, 4-7 on sim-node-1)."""
    return HostLoads(
        {rank: RankHostLoad(rank, f"sim-node-{rank // 4}", ms / 1e3, 40.0, 6) for rank, ms in delays_ms.items()},
        pressure or {},
    )


def test_a_straggler_from_the_traces_alone_has_cause_unknown_saying_what_is_missing(straggler):
    assert straggler.cause is Cause.UNKNOWN
    assert "cannot be told from a starved host" in straggler.cause_evidence
    assert straggler.evidence["gpu_queue_ms"] is None, "no GPU timing in this run"


def test_a_straggler_waiting_for_a_cpu_far_longer_than_its_peers_is_cause_host(straggler):
    found = attribute(straggler, loads({**{rank: 4.0 for rank in range(8)}, 6: 310.0}))
    assert found.cause is Cause.HOST
    assert "rank 6's process waited 310 ms per second for a CPU" in found.cause_evidence
    assert "median 4 ms/s of its 7 peers" in found.cause_evidence


def test_a_straggler_whose_host_is_as_calm_as_its_peers_is_cause_compute(straggler):
    found = attribute(straggler, loads({**{rank: 4.0 for rank in range(8)}, 6: 6.0}))
    assert found.cause is Cause.COMPUTE
    assert "longer than its peers'" in found.cause_evidence and "rank 6 waited 6 ms/s" in found.cause_evidence


def test_a_busy_machine_delaying_every_rank_alike_is_not_blamed_on_the_host(straggler):
    found = attribute(straggler, loads({rank: 120.0 + rank for rank in range(8)}))
    assert found.cause is Cause.COMPUTE


def test_node_cpu_pressure_far_above_the_other_nodes_is_cause_host(straggler):
    found = attribute(straggler, loads({}, {"sim-node-1": 0.72, "sim-node-0": 0.05}))
    assert found.cause is Cause.HOST and "sim-node-1's CPUs were contended 72%" in found.cause_evidence
    alone = attribute(straggler, loads({}, {"sim-node-1": 0.72}))
    assert alone.cause is Cause.UNKNOWN, "one node's pressure alone singles out nobody"


def test_a_finding_that_names_nobody_is_not_attributed_even_to_a_starved_host(straggler):
    unnamed = dataclasses.replace(straggler, kind="hang", ranks=[], nodes=[])
    found = attribute(unnamed, loads({**{rank: 4.0 for rank in range(8)}, 6: 310.0}))
    assert found.cause is Cause.UNKNOWN and "no rank is named" in found.cause_evidence


def test_missing_figures_for_the_culprit_leave_the_cause_unknown(straggler):
    found = attribute(straggler, loads({rank: 4.0 for rank in range(8) if rank != 6}))
    assert found.cause is Cause.UNKNOWN


def test_a_straggler_whose_gpu_is_behind_its_host_is_cause_compute_from_the_traces(straggler):
    queued = dataclasses.replace(straggler, evidence={**straggler.evidence, "gpu_queue_ms": 5.0})
    found = attribute(queued)
    assert found.cause is Cause.COMPUTE and "waited 5.00 ms on its GPU behind earlier work" in found.cause_evidence


def test_the_cause_survives_the_json_report_and_old_reports_read_as_unknown(straggler):
    found = attribute(straggler, loads({**{rank: 4.0 for rank in range(8)}, 6: 310.0}))
    document = AnalysisReport([found], []).to_json()
    assert document["findings"][0]["cause"] == "host"
    assert AnalysisReport.from_json(document).findings[0] == found
    old = {key: value for key, value in found.to_json().items() if key not in ("cause", "cause_evidence")}
    assert Finding.from_json(old).cause is Cause.UNKNOWN


def test_rankwatch_analyze_prints_the_cause(straggler, tmp_path_factory):
    directory = tmp_path_factory.mktemp("text")
    run(Simulation(world_size=4, tp=4, steps=3, compute_us=500, ranks_per_node=4), directory)
    trace = load_path(directory)
    text = summary_text(AnalysisReport([straggler], []), trace)
    assert "\n  cause unknown: its time between collectives is" in text
