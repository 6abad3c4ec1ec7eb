"""Hundreds to a thousand ranks whose hosts run ahead of their GPUs: the vectorised model
(standins/scenario.py, ``run_ahead=True``), where real processes cannot go on this machine. A hang
leaves the GPUs that wait for the culprit stuck while their hosts go on launching up to the step's
synchronisation, as real NCCL does; the culprit must still be named first, and call times alone must
never name a wrong rank."""

from __future__ import annotations

import pytest

from rankwatch.analysis.analyze import analyze
from rankwatch.standins.scenario import Scenario, generate

BASE = {"clock_skew_us": 2000.0, "jitter": 0.03, "run_ahead": True, "ranks_per_node": 8, "compute_us": 1000}
LAYOUTS = [(1024, 8, 2), (512, 2, 8), (256, 1, 4)]


def findings_of(scenario: Scenario) -> list[tuple[str, list[int]]]:
    return [(finding["kind"], finding["ranks"]) for finding in analyze(generate(scenario).trace)["findings"]]


@pytest.mark.parametrize("gpu_timing", [True, False], ids=["gpu-timed", "host-only"])
@pytest.mark.parametrize(("world", "tp", "pp"), LAYOUTS)
def test_a_rank_that_never_calls_is_named_first(world, tp, pp, gpu_timing):
    culprit = world // 3 + 1
    scenario = Scenario(world, tp=tp, pp=pp, gpu_timing=gpu_timing, hang_rank=culprit, hang_at_call=150, **BASE)
    findings = findings_of(scenario)
    assert findings and findings[0] == ("hang", [culprit]), findings


@pytest.mark.parametrize(("world", "tp", "pp"), LAYOUTS)
def test_a_collective_that_never_starts_on_one_gpu(world, tp, pp):
    """Its peers' GPUs started it and wait: GPU times name the culprit alone. Without them every host
    made every call of the step and waits in the same synchronisation, as at the end of a finished
    run: nobody is named, and the report says why."""
    culprit = world // 2 + 3
    stuck = {"stuck_rank": culprit, "stuck_at_call": 150}
    timed = findings_of(Scenario(world, tp=tp, pp=pp, gpu_timing=True, **stuck, **BASE))
    assert timed and timed[0] == ("hang", [culprit]), timed
    untimed = analyze(generate(Scenario(world, tp=tp, pp=pp, gpu_timing=False, **stuck, **BASE)).trace)
    assert all(not finding["ranks"] for finding in untimed["findings"]), untimed["findings"]
    assert any("not localisable from call times" in problem for problem in untimed["problems"]), untimed["problems"]


def test_a_gpu_hardly_slower_than_its_peers_is_not_a_straggler():
    """No two GPUs run alike: in this healthy run rank 30 computes 1.6% more than its TP peer and is last
    in 74% of their collectives; below 2.5% nobody would cordon a node for it (it was named once)."""
    assert findings_of(Scenario(128, tp=2, pp=4, gpu_timing=True, seed=1, **BASE)) == []
