"""Hundreds to a thousand ranks whose hosts run ahead of their GPUs: the vectorised model
(standins/scenario.py, ``run_ahead=True``), where real processes cannot go on this machine. A hang
leaves the GPUs that wait for the culprit stuck while their hosts go on launching up to the step's
synchronisation, as real NCCL does; the culprit must still be named first, and call times alone must
never name a wrong rank."""

from __future__ import annotations

import numpy as np
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


def test_host_scheduling_inside_calls_that_return_at_once_names_nobody():
    """Without GPU times a run-ahead host's call lasts microseconds of its own scheduling, not a wait for
    a peer. On a busy machine (two test workers once) the other ranks' hosts were descheduled inside
    their calls a few microseconds more often than rank 7's, so rank 7 "waited least" in most
    collectives and was named a straggler, its node cordoned, with "0.00 ms longer than its peers'"."""
    run = generate(Scenario(64, tp=4, pp=2, gpu_timing=False, **BASE))
    calls = run.trace.calls
    rng = np.random.default_rng(7)
    descheduled = rng.uniform(0, 20_000, len(calls)).astype(np.int64) * (calls["rank"] != 7)
    calls["t_return"][:] = calls["t_return"] + descheduled * (calls["t_return"] > 0)
    report = analyze(run.trace)
    assert report["findings"] == [], report["findings"]
    assert any("not localisable from call times" in problem for problem in report["problems"]), report["problems"]
