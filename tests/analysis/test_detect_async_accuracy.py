"""Detection quality on real runs of the asynchronous stand-in device, in the layouts and faults the
accuracy bench (`bench/analysis_accuracy.py --suite async`) found wanting: no tensor parallelism,
slow pipeline links, a stuck send/receive (never started on the culprit's GPU, or started on both sides
and never ended), and host call times only (no wrong rank, ever)."""

from __future__ import annotations

from pathlib import Path

from rankwatch.analysis.analyze import analyze
from rankwatch.analysis.compute_gaps import detect_compute_stragglers
from rankwatch.analysis.load import load_path
from rankwatch.analysis.sync_points import stopped_at_sync
from rankwatch.standins.simulate import Faults, Simulation, run

RINGS = Path(__file__).parent / "rings"  # rings of real runs whose analysis went wrong once


def simulate(out, gpu_timing: bool, world_size: int, tp: int, pp: int, faults: Faults | None = None, **kwargs):
    faults = faults or Faults()
    simulation = Simulation(world_size=world_size, tp=tp, pp=pp, ranks_per_node=4, device="async",
                            gpu_timing=gpu_timing, faults=faults, **kwargs)  # fmt: skip
    run(simulation, out, log=lambda _message: None)
    trace = load_path(out)
    return trace, analyze(trace)


def named(document: dict) -> list[tuple[str, list[int]]]:
    return [(finding["kind"], finding["ranks"]) for finding in document["findings"]]


def test_host_only_hang_names_the_rank_that_never_called_not_the_last_stage_blocked_in_its_loss(tmp_path):
    # TP1 PP8: the last stage's host blocks in its loss .item() early in the step, so it also stops
    # calling before its peers; it stopped where it blocks every step, with a receive never matched
    trace, document = simulate(tmp_path, False, 8, 1, 8, Faults(hang_rank=6, hang_at=141), steps=30, compute_us=1000)
    assert named(document) == [("hang", [6])], document["findings"]
    assert stopped_at_sync(trace, 7) and not stopped_at_sync(trace, 6)


def test_host_only_hang_at_a_step_boundary_still_names_the_rank(tmp_path):
    # rank 6 never makes the call right after its grad-norm synchronisation: it stopped where its
    # host blocks every step, but its peers were released from that synchronisation and went on
    trace, document = simulate(tmp_path, False, 8, 4, 2, Faults(hang_rank=6, hang_at=53), steps=30, compute_us=1000)
    assert named(document) == [("hang", [6])], document["findings"]
    assert stopped_at_sync(trace, 6)


def test_host_only_stopped_device_names_nobody_and_says_so(tmp_path):
    # rank 3's GPU stops; every host goes on to its next synchronisation and blocks there: who
    # stopped calling first is the pipeline's structure (the last stage's loss), not the culprit
    _, document = simulate(
        tmp_path, False, 8, 1, 8, Faults(device_stop_rank=3, device_stop_at_kernel=92), steps=30, compute_us=1000
    )
    [hang] = document["findings"]
    assert (hang["kind"], hang["ranks"], hang["nodes"]) == ("hang", [], []), hang
    assert "not localisable from call times; enable GPU timing" in hang["summary"]


def test_gpu_timed_straggler_without_tensor_parallelism_is_named_and_a_healthy_run_is_not(tmp_path):
    # TP1 PP8: no collective with peers doing the same work; the slow GPU computes a larger share of the
    # run between its NCCL operations than the other stages
    _, slow = simulate(tmp_path / "slow", True, 8, 1, 8, Faults(slow_rank=4, slowdown=0.2), steps=40, compute_us=3000)
    assert named(slow) == [("straggler", [4])], slow["findings"]
    assert slow["findings"][0]["evidence"]["step_compute_ms"] > slow["findings"][0]["evidence"]["peer_step_compute_ms"]
    _, healthy = simulate(tmp_path / "healthy", True, 8, 1, 8, steps=40, compute_us=3000)
    assert healthy["findings"] == [], healthy["findings"]


def test_gpu_timed_5_percent_straggler_is_named_from_its_compute_per_step(tmp_path):
    # 8 ranks TP2 PP4: its TP peer's waits for a 5% slower GPU drown in the noise of a loaded machine;
    # each gap between NCCL operations at its least over the steps shows the GPU's own compute
    _, slow = simulate(tmp_path, True, 8, 2, 4, Faults(slow_rank=2, slowdown=0.05), steps=20, compute_us=3000)
    assert named(slow) == [("straggler", [2])], slow["findings"]


def test_gpu_timed_slow_pipeline_link_is_named_from_gpu_times(tmp_path):
    # the sends and receives return at once on the host; on the GPU the slow pair's transfers take
    # the link's 3 ms on top of the others'
    _, document = simulate(
        tmp_path, True, 8, 2, 4, Faults(slow_link=(5, 7), link_latency_us=3000), steps=20, compute_us=3000
    )
    assert named(document)[:1] == [("slow_link", [5, 7])], document["findings"]
    assert all(set(finding["ranks"]) <= {5, 7} for finding in document["findings"]), document["findings"]


def test_gpu_timed_stuck_send_or_receive_names_the_rank_whose_gpu_never_started_it(tmp_path):
    # the accuracy bench's stuck runs (seeds 0 and 2): the culprit's operation was enqueued (its host
    # returned) and never started on its GPU, while the peer's matching call started and waits; before,
    # the pair was taken for "both started" (5 and 7 named) or the peer's wait for finished (no finding)
    _, pipeline = simulate(
        tmp_path / "pp8", True, 8, 1, 8, Faults(stuck_rank=6, stuck_at=46), steps=30, compute_us=1000
    )
    assert named(pipeline) == [("hang", [6])], pipeline["findings"]
    _, tp2 = simulate(tmp_path / "tp2", True, 8, 2, 4, Faults(stuck_rank=5, stuck_at=59), steps=30, compute_us=1000)
    assert named(tp2) == [("hang", [5])], tp2["findings"]
    assert tp2["findings"][0]["nodes"] == ["sim-node-1"]


def test_gpu_timed_stuck_receive_names_the_rank_the_pipeline_waits_for(tmp_path):
    # rank 6's receive from the last stage starts on its GPU and never completes (so does rank 7's
    # matching send); every earlier stage waits for rank 6's next send, queued behind it
    faults = Faults(never_ends_rank=6, never_ends_at=46)
    _, document = simulate(tmp_path, True, 8, 1, 8, faults, steps=30, compute_us=1000)
    assert named(document) == [("hang", [6])], document["findings"]


def test_gpu_timed_healthy_pipeline_names_no_straggler_from_where_its_windows_cut_the_steps(unpacked):
    # rings of a real healthy run (8 ranks TP1 PP8, GPU-timed, 20 steps of 3 ms kernels) that named
    # rank 7 a straggler (+3.6% against a floor of 2.5%): time windows cut the steps at arbitrary
    # points, and the last stages compute late in each step, so a window held more of their work.
    # Steps between the world AllReduce's ends hold the same work for every stage.
    rings = unpacked(RINGS / "healthy-8-ranks-tp1-pp8-gpu-timed.tar.gz")
    assert detect_compute_stragglers(load_path(rings)) == []
