"""`rankwatch analyze` on real traces of `rankwatch simulate` runs with known ground truth, on the synchronous
device without GPU timing (host waits are GPU waits). The asynchronous device, the default, with GPU timing
on and off, is in test_detect_async.py and test_detect_async_accuracy.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from rankwatch.analysis.analyze import analyze
from rankwatch.analysis.load import load_path
from rankwatch.analysis.trace import CALL_DTYPE, Trace
from rankwatch.standins.simulate import Faults, Simulation, run

SYNC = {"device": "sync", "gpu_timing": False}


def simulate(tmp_path, compute_us: int = 1000, **kwargs) -> dict:
    faults = kwargs.pop("faults", Faults())
    run(Simulation(**SYNC, compute_us=compute_us, ranks_per_node=4, faults=faults, **kwargs), tmp_path)
    return analyze(load_path(tmp_path))


def test_healthy_run_has_no_finding(tmp_path):
    document = simulate(tmp_path, world_size=8, tp=2, pp=2, steps=15)
    assert document["healthy"] is True and document["findings"] == [], document["findings"]


def test_straggler_is_named_with_its_node(tmp_path):
    # 16 processes share two cores: compute long enough that a 30% slowdown stands above the noise
    document = simulate(tmp_path, 3000, world_size=16, tp=4, pp=2, steps=12, faults=Faults(slow_rank=6, slowdown=0.3))
    top = document["findings"][0]
    assert (top["kind"], top["ranks"], top["nodes"]) == ("straggler", [6], ["sim-node-1"])
    assert top["evidence"]["own_wait_ms"] < top["evidence"]["peer_wait_ms"]
    assert [f["ranks"] for f in document["findings"]] == [[6]], "nobody else is blamed"
    # the traces alone cannot tell slower compute from a starved host: the cause says so, never guesses
    assert top["cause"] == "unknown" and "cannot be told from a starved host" in top["cause_evidence"]
    assert "longer than its peers'" in top["cause_evidence"]


def test_fail_slow_reports_onset_degradation_and_the_rank_behind_it(tmp_path):
    # 9 NCCL calls per step at TP=4/PP=1: from call 180 on, rank 2 computes twice as long (step 20 on);
    # 5 ms of compute a step, so that a busy machine's scheduling delays stay small beside the rise
    document = simulate(tmp_path, 5000, world_size=8, tp=4, steps=40,
                        faults=Faults(slow_rank=2, slowdown=1.0, slow_from_call=180))  # fmt: skip
    kinds = [f["kind"] for f in document["findings"]]
    assert "fail_slow" in kinds, document["findings"]
    fail_slow = document["findings"][kinds.index("fail_slow")]
    # a busy machine's own slow steps just before the real onset (step 20) can join its run of three
    assert 17 <= fail_slow["evidence"]["onset_step"] <= 21
    assert 0.6 <= fail_slow["evidence"]["degradation"] <= 1.4
    assert fail_slow["ranks"] == [2]
    assert {f["kind"] for f in document["findings"]} <= {"fail_slow", "straggler"}

    from html.parser import HTMLParser

    from rankwatch.analysis.html_report import html_report

    class Shapes(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tags: list[tuple[str, dict]] = []

        def handle_starttag(self, tag, attrs):
            self.tags.append((tag, dict(attrs)))

    page = html_report(load_path(tmp_path), document)
    shapes = Shapes()
    shapes.feed(page)
    [line] = [attrs for tag, attrs in shapes.tags if tag == "polyline"]
    assert len(line["points"].split()) == 39, "one point per step interval"
    assert any(tag == "line" and attrs.get("stroke") == "red" for tag, attrs in shapes.tags), "onset marked"
    cells = [attrs for tag, attrs in shapes.tags if tag == "rect"]
    assert len({attrs["y"] for attrs in cells}) == 8, "one heatmap row per rank"
    assert "FAIL_SLOW" in page and "<script" not in page


def test_slow_link_names_the_pair_and_blames_no_straggler(tmp_path):
    document = simulate(
        tmp_path, world_size=8, tp=2, pp=4, steps=6, faults=Faults(slow_link=(2, 4), link_latency_us=20000)
    )
    [link] = document["findings"]
    assert link["kind"] == "slow_link" and sorted(link["ranks"]) == [2, 4]
    assert link["evidence"]["median_transfer_ms"] > 10 * link["evidence"]["typical_transfer_ms"]
    assert link["cause"] == "communication" and "transfers between ranks" in link["cause_evidence"]


def test_hang_names_the_rank_that_stopped_not_the_waiters(tmp_path):
    document = simulate(tmp_path, world_size=8, tp=2, pp=2, steps=50, faults=Faults(hang_rank=5, hang_at=30))
    assert len(document["findings"]) == 1
    hang = document["findings"][0]
    assert (hang["kind"], hang["ranks"], hang["nodes"]) == ("hang", [5], ["sim-node-1"])
    assert hang["evidence"]["waiting_ranks"] == [0, 1, 2, 3, 4, 6, 7]
    assert hang["confidence"] >= 0.9


def test_rank_stuck_inside_a_collective_is_told_apart_from_waiting(tmp_path):
    document = simulate(tmp_path, world_size=4, tp=4, steps=50, faults=Faults(stuck_rank=2, stuck_at=12))
    [hang] = document["findings"]
    assert hang["kind"] == "hang" and hang["evidence"]["stuck"] is True
    assert 2 in hang["ranks"] and hang["confidence"] < 0.5, "without GPU timing the stuck member is not singled out"


def test_rank_calling_a_broadcast_where_its_peers_all_reduce_is_a_mismatch_not_a_hang(tmp_path):
    # its TP group never completes the collective: the hang that follows is the mismatch's, and only rank 6
    # is named, as software (no node at fault)
    document = simulate(tmp_path, world_size=8, tp=4, pp=2, steps=50, faults=Faults(mismatch_rank=6, mismatch_at=25))
    [finding] = document["findings"]
    assert (finding["kind"], finding["ranks"], finding["cause"]) == ("mismatch", [6], "software"), finding
    assert finding["evidence"]["mismatch"] == ["op"] and finding["evidence"]["calls"]["6"].startswith("Broadcast")
    assert any("the hang follows from the mismatched collective" in problem for problem in document["problems"])


def test_unreadable_ring_is_reported_and_the_rest_analysed(tmp_path):
    run(
        Simulation(**SYNC, world_size=4, tp=2, steps=10, compute_us=500, faults=Faults(hang_rank=1, hang_at=8)),
        tmp_path,
    )
    (tmp_path / "rankwatch-garbage-1.ring").write_bytes(b"not a ring at all" * 300)
    out = tmp_path / "report.json"
    timeline = tmp_path / "timeline.json"
    result = subprocess.run(
        [sys.executable, "-m", "rankwatch", "analyze", "--log-path", str(tmp_path), "--json", str(out),
         "--chrome-trace", str(timeline)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "warning:" in result.stdout and "not a rankwatch ring" in result.stdout
    assert "HANG" in result.stdout and "rank 1" in result.stdout
    document = json.loads(out.read_text())
    assert document["schema"] == 1 and document["healthy"] is False
    assert document["findings"][0]["ranks"] == [1]
    events = json.loads(timeline.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1, 2, 3} and all(e["dur"] >= 0 for e in slices)
    assert any(e["args"]["pending"] for e in slices if e["pid"] == 0), "the waiters' last calls are open"
    markers = [e for e in events if e["ph"] == "i"]
    assert [m["pid"] for m in markers] == [1] and markers[0]["name"].startswith("HANG: rank 1")


def test_layout_names_the_group_and_coordinates(tmp_path):
    run(Simulation(**SYNC, world_size=16, tp=4, pp=2, steps=12, compute_us=3000, ranks_per_node=4,
                   faults=Faults(slow_rank=6, slowdown=0.3)), tmp_path)  # fmt: skip
    (tmp_path / "config.yaml").write_text("TP: 4\nPP: 2\nworld_size: 16\n")
    result = subprocess.run(
        [sys.executable, "-m", "rankwatch", "analyze", str(tmp_path), "--config-path", str(tmp_path / "config.yaml")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert "rank 6 (tp 2, dp 1, pp 0) on node sim-node-1 arrives last at the collectives of TP group" in result.stdout
    bad = subprocess.run([sys.executable, "-m", "rankwatch", "analyze", str(tmp_path), "--tp", "4"],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "--tp/--pp need --world-size" in bad.stderr


def test_bad_arguments_are_clear(tmp_path):
    result = subprocess.run([sys.executable, "-m", "rankwatch", "analyze", str(tmp_path / "nothing")],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2 and "no such file or directory" in result.stderr
    with pytest.raises(ValueError, match="--test-type must be one of"):
        analyze(Trace(np.zeros(0, CALL_DTYPE), {}, {}), "everything")


def test_hang_found_from_megatrace_logs_of_the_same_run(tmp_path):
    """A run written out in Megatrace's format (call times only) still names the culprit."""
    from rankwatch.analysis.megatrace import read_logs, write_logs

    run(Simulation(**SYNC, world_size=8, tp=2, pp=2, steps=50, compute_us=1000, faults=Faults(hang_rank=5, hang_at=30)),
        tmp_path / "rings")  # fmt: skip
    write_logs(load_path(tmp_path / "rings"), tmp_path / "megatrace")
    logs = read_logs(tmp_path / "megatrace")
    # the logs alone end moments after the stop: no stall in them, but rank 5's end short of its peers'
    alone = analyze(logs)
    assert not [f for f in alone["findings"] if f["kind"] == "hang"], alone["findings"]
    assert any(p.startswith("rank 5's records end") for p in alone["problems"]), alone["problems"]
    logs.observed_until_ns = time.time_ns()  # the job seen hung when its logs were collected
    document = analyze(logs)
    assert [f["ranks"] for f in document["findings"]] == [[5]]
    slow = analyze(read_logs(tmp_path / "megatrace"), "slow")
    assert "slow links need return times" in slow["problems"][0]
    assert "host clocks taken as aligned" in slow["problems"][1]
