"""MegaScan's traces: the published runs of github.com/OpenSQZ/MegatronApp (see megascan/NOTICE), runs of
the Megatron model written in MegaScan's format with a known culprit, and malformed input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rankwatch.analysis.analyze import analyze
from rankwatch.analysis.load import load_path
from rankwatch.analysis.megascan import MegaScanError, write_traces
from rankwatch.analysis.trace import BACKWARD, FORWARD
from rankwatch.standins.scenario import Scenario, generate

PUBLISHED = Path(__file__).parent / "megascan" / "megatronapp-published-runs.tar.gz"
PP_RUN = "data-1-pipeline-4-tensor-1-pp"


@pytest.fixture(scope="module")
def published(unpacked) -> Path:
    return unpacked(PUBLISHED)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rankwatch", "analyze", *args], capture_output=True, text=True)


def test_a_published_run_is_read_rank_by_rank_with_its_layout_from_the_file_names(published: Path):
    trace = load_path(published / PP_RUN)
    assert (trace.layout.tp, trace.layout.pp, trace.layout.world_size) == (1, 4, 4)
    assert sorted(trace.ranks) == [0, 1, 2, 3]
    # 20 iterations of 8 microbatches x 4 model chunks, a forward and a backward each, on every rank
    assert len(trace.iterations) == 80 and len(trace.spans) == 4 * 20 * 32 * 2
    spans = trace.spans[trace.spans["rank"] == 3]
    assert set(np.unique(spans["chunk"]).tolist()) == {0, 1, 2, 3} and set(np.unique(spans["microbatch"])) == set(
        range(8)
    )
    forward = (spans["end"] - spans["start"])[spans["kind"] == FORWARD]
    backward = (spans["end"] - spans["start"])[spans["kind"] == BACKWARD]
    assert 4.0 < np.median(forward) / 1e6 < 4.2 and 7.1 < np.median(backward) / 1e6 < 7.3  # ms, the last stage
    assert len(trace.calls) == 0  # the default granularity of that version recorded no communication


def test_a_published_run_is_healthy_and_the_report_gives_the_spread_that_says_why(published: Path, tmp_path: Path):
    result = cli(str(published / PP_RUN), "--json", str(tmp_path / "report.json"))
    assert result.returncode == 0, result.stderr
    assert "healthy: no hang, no straggler, no slow link, no fail-slow" in result.stdout
    document = json.loads((tmp_path / "report.json").read_text())
    assert document["healthy"] and not document["findings"]
    problems = "\n".join(document["problems"])
    # one rank per pipeline stage: nobody does the same work, so only the run's own history is judged
    assert "1 rank(s) per pipeline stage (TP x DP): no peers doing the same work" in problems
    assert "iteration time 715.8 ms (median of 20 iterations, spread 0.3%): no lasting rise of 20%" in problems
    assert "each rank's compute per iteration" in problems


def test_the_aggregated_file_of_a_run_reads_as_its_per_rank_files(published: Path):
    per_rank = load_path(published / PP_RUN)
    aggregated = load_path(published / PP_RUN / f"{PP_RUN}-aggregated.json")
    assert sorted(aggregated.ranks) == sorted(per_rank.ranks) and len(aggregated.spans) == len(per_rank.spans)
    for trace in (per_rank, aggregated):
        order = np.lexsort((trace.spans["microbatch"], trace.spans["chunk"], trace.spans["kind"],
                            trace.spans["iteration"], trace.spans["rank"]))  # fmt: skip
        trace.spans = trace.spans[order]
    durations = [(t.spans["end"] - t.spans["start"]) for t in (per_rank, aggregated)]
    assert np.abs(durations[0] - durations[1]).max() <= 1_000  # the aggregate keeps µs
    assert analyze(aggregated)["healthy"]


def test_the_newer_aggregate_with_iteration_instants_is_read_and_healthy(published: Path):
    trace = load_path(published / "profiling" / "data-1-pipeline-4-tensor-1-dpp-aggregated.json")
    assert sorted(trace.ranks) == [0, 1, 2, 3] and len(trace.iterations) == 80
    document = analyze(trace)
    assert document["healthy"], document["findings"]
    assert any("iteration time 954.4 ms (median of 20 iterations" in p for p in document["problems"])


def write_run(directory: Path, communication: bool = True, **scenario) -> Scenario:
    model = Scenario(**scenario)
    write_traces(generate(model).trace, directory, microbatches=model.microbatches)
    if not communication:  # as MegaScan's default granularity of 2025-06 wrote them: compute and iterations only
        for path in directory.glob("benchmark-*.json"):
            kept = [r for r in json.loads(path.read_text()) if r["name"] in ("iteration", "forward", "backward")]
            path.write_text(json.dumps(kept))
    return model


@pytest.mark.parametrize("communication", [True, False], ids=["full granularity", "compute only"])
def test_a_slower_gpu_is_named_first_and_nobody_else(tmp_path: Path, communication: bool):
    write_run(tmp_path, communication, world_size=32, tp=1, pp=4, seed=2, stragglers=((13, 0.1),))
    document = analyze(load_path(tmp_path))
    findings = document["findings"]
    assert findings and findings[0]["kind"] == "straggler" and findings[0]["ranks"] == [13], findings
    assert {rank for f in findings for rank in f["ranks"]} == {13}


def test_a_slower_gpu_in_a_tensor_parallel_group_is_told_from_its_waiting_peers(tmp_path: Path):
    write_run(tmp_path, world_size=64, tp=4, pp=2, seed=5, stragglers=((22, 0.1),))
    findings = analyze(load_path(tmp_path))["findings"]
    assert findings and findings[0]["ranks"] == [22] and {r for f in findings for r in f["ranks"]} == {22}


def test_spans_holding_unrecorded_tp_collectives_name_nobody(tmp_path: Path):
    """A slow rank's TP peers wait for it inside their spans; without the collectives recorded that
    waiting cannot be told from compute (a pipeline neighbour's TP peer came out slower than the floor)."""
    write_run(tmp_path, False, world_size=16, tp=2, pp=2, seed=3, stragglers=((6, 0.2),))
    document = analyze(load_path(tmp_path))
    assert not document["findings"]
    assert any(
        "waits for its TP peers cannot be told from its compute, nobody is named" in p for p in document["problems"]
    )


def test_a_slowdown_from_an_iteration_on_is_a_fail_slow_with_the_rank_behind_it(tmp_path: Path):
    write_run(tmp_path, False, world_size=32, tp=1, pp=4, seed=4, steps=24, stragglers=((13, 0.5),), slow_from_step=10)
    findings = analyze(load_path(tmp_path))["findings"]
    slow = [f for f in findings if f["kind"] == "fail_slow"]
    assert slow and slow[0]["ranks"] == [13] and slow[0]["evidence"]["onset_iteration"] in (8, 9, 10), slow
    assert slow[0]["evidence"]["degradation"] >= 0.2
    assert {rank for f in findings for rank in f["ranks"]} == {13}


def test_a_healthy_simulated_run_is_healthy_with_its_spread(tmp_path: Path):
    write_run(tmp_path, world_size=32, tp=2, pp=2, seed=6)
    document = analyze(load_path(tmp_path))
    assert document["healthy"], document["findings"]
    assert any(p.startswith("compute spans against their pipeline stage's ranks: 32 ranks within") for p in
               document["problems"])  # fmt: skip


def test_an_archive_holding_megascan_traces_is_analysed(tmp_path: Path):
    archive = tmp_path / "archive"
    (archive / "files" / "worker-0" / "megascan").mkdir(parents=True)
    write_run(archive / "files" / "worker-0" / "megascan", world_size=32, tp=1, pp=4, seed=2, stragglers=((13, 0.2),))
    (archive / "manifest.json").write_text(json.dumps({"namespace": "ml", "job": "gpt", "attempt": 0}))
    result = cli(str(archive), "--json", str(tmp_path / "report.json"))
    assert result.returncode == 0, result.stderr
    assert "MegaScan traces" in result.stderr
    assert json.loads((tmp_path / "report.json").read_text())["findings"][0]["ranks"] == [13]


def records(*scopes: tuple) -> bytes:
    """One iteration holding ``scopes`` (name, ph, rel_ts, attrs...) as a rank file's bytes."""
    inside = [
        {"name": name, "ph": phase, "rel_ts": at, **(attrs[0] if attrs else {})} for name, phase, at, *attrs in scopes
    ]
    end = {"name": "iteration", "ph": "E", "rel_ts": 10, "duration_cuda": 10, "duration_wall": 11}
    return json.dumps([{"name": "iteration", "ph": "B", "pad_before": 0}, *inside, end]).encode()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'[{"name": "iteration", "ph": "B"', "not valid JSON"),
        (json.dumps({"name": "iteration"}).encode(), "expected a JSON list of MegaScan records"),
        (json.dumps([1, 2]).encode(), "record 0 is not a MegaScan record"),
        (records(("forward", "B", 1), ("backward", "E", 2)), "record 2: the end of 'backward' closes 'forward'"),
        (records(("forward", "B", "1")), "rel_ts '1' is not a number"),
        (records(("forward", "B", 5), ("forward", "E", 1)), "'forward' ends 4 ns before it begins"),
        (records(("forward", "B", 1), ("forward", "E", 2, {"microbatch": -3})), "microbatch -3 is outside"),
        (records(("forward", "B", 1e300)), "out of range"),
    ],
)
def test_a_corrupt_rank_file_is_a_problem_naming_it_and_the_other_ranks_are_still_read(
    tmp_path: Path, content: bytes, message: str
):
    write_run(tmp_path, world_size=32, tp=1, pp=4, seed=2, stragglers=((13, 0.2),))
    bad = tmp_path / "benchmark-data-0-pipeline-3-tensor-0.json"  # rank 24
    bad.write_bytes(content)
    trace = load_path(tmp_path)
    assert 24 not in trace.ranks and len(trace.ranks) == 31
    assert any(str(bad) in p and message in p for p in trace.problems), trace.problems
    assert analyze(trace)["findings"][0]["ranks"] == [13]
    result = cli(str(tmp_path))  # the culprit is named, but without rank 24 the analysis is inconclusive
    assert result.returncode == 1 and "1 of 32 ranks have no trace (rank 24)" in result.stdout + result.stderr


def test_unreadable_megascan_input_is_a_clear_error_not_a_crash(tmp_path: Path):
    (tmp_path / "benchmark-data-0-pipeline-0-tensor-0.json").write_text("{ not json")
    result = cli(str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no MegaScan trace could be read" in result.stderr and "not valid JSON" in result.stderr
    unnamed = tmp_path / "trace.json"  # an aggregate that says nowhere which rank a process is
    unnamed.write_text(
        json.dumps([{"name": "forward", "ph": "X", "ts": 1, "dur": 2, "pid": 7, "args": {"iteration": 0}}])
    )
    result = cli(str(unnamed))
    assert result.returncode == 2 and "cannot tell which rank process 7 is" in result.stderr
    (tmp_path / "benchmark-data-0-pipeline-0-tensor-0.json").unlink()
    huge = tmp_path / "benchmark-data-0-pipeline-70000-tensor-70000.json"  # a name, not a job of 4.9e9 ranks
    huge.write_text(json.dumps(json.loads(records(("forward", "B", 1), ("forward", "E", 2)))))
    result = cli(str(tmp_path))
    assert result.returncode == 2 and "a world of 4900140001 ranks, more than rankwatch reads" in result.stderr


def test_an_aggregate_of_two_runs_is_refused(published: Path, tmp_path: Path):
    events = json.loads((published / PP_RUN / f"{PP_RUN}-aggregated.json").read_text())
    merged = tmp_path / "merged_trace.json"
    merged.write_text(json.dumps(events + [{**e, "tid": 1} for e in events]))
    with pytest.raises(MegaScanError, match="several threads: not one MegaScan run"):
        load_path(merged)


def test_the_writer_refuses_a_run_whose_steps_it_cannot_split_into_microbatches(tmp_path: Path):
    model = Scenario(world_size=8, tp=1, pp=1, seed=1)  # data parallel only: no call inside a microbatch
    with pytest.raises(ValueError, match="MegaScan's spans cannot be placed"):
        write_traces(generate(model).trace, tmp_path, microbatches=model.microbatches)


def aggregate_as_megascan_does(directory: Path) -> Path:
    """One Chrome trace of a run's per-rank files, as MegaScan's scripts/aggregate.py (2025-11) writes it:
    each scope an ``X`` slice (µs) on one timeline, ``pid`` the global rank, named ``DP<d>-PP<p>-TP<t>``."""
    events = []
    for path in sorted(directory.glob("benchmark-*.json")):
        timeline, iteration, opened = 0, -1, []
        for record in json.loads(path.read_text()):
            name, phase = record["name"], record["ph"]
            if name == "iteration":
                iteration += phase == "B"
                timeline += record.get("duration_wall", 0)
                continue
            at = timeline + record["rel_ts"]
            if phase == "B":
                opened.append(at)
                continue
            start = opened.pop()
            attrs = {k: v for k, v in record.items() if k not in ("name", "ph", "rel_ts")}
            events.append({"name": name, "ph": "X", "ts": start / 1e3, "dur": (at - start) / 1e3,
                           "pid": record["g_rk"], "tid": 0, "args": {"iteration": iteration, **attrs}})  # fmt: skip
        events.append({"ph": "M", "name": "process_name", "pid": record["g_rk"],
                       "args": {"name": f"DP{record['dp_rk']}-PP{record['pp_rk']}-TP{record['tp_rk']}"}})  # fmt: skip
    out = directory.parent / "trace_output.json"
    out.write_text(json.dumps(sorted(events, key=lambda e: e.get("ts", 0))))
    return out


def test_a_newer_aggregate_of_slices_names_the_same_culprit_as_its_rank_files(tmp_path: Path):
    runs = tmp_path / "run"
    write_run(runs, world_size=32, tp=2, pp=2, seed=7, stragglers=((21, 0.2),))
    per_rank, aggregated = load_path(runs), load_path(aggregate_as_megascan_does(runs))
    assert sorted(aggregated.ranks) == sorted(per_rank.ranks) == list(range(32))
    assert len(aggregated.spans) == len(per_rank.spans) and len(aggregated.calls) == len(per_rank.calls)
    for trace in (per_rank, aggregated):
        findings = analyze(trace)["findings"]
        assert findings[0]["ranks"] == [21] and {r for f in findings for r in f["ranks"]} == {21}, findings


def test_a_run_of_the_stand_in_device_written_as_megascan_names_its_slower_gpu(tmp_path: Path):
    """A real `rankwatch simulate` run (asynchronous device, GPU-timed; its driver receives before a
    backward computes) written in MegaScan's format: the slower GPU is named, from the collectives and
    from the spans alone."""
    from rankwatch.analysis.compute_spans import detect_span_stragglers
    from rankwatch.analysis.topology import Layout
    from rankwatch.standins.simulate import Faults, Simulation, run

    rings, traces = tmp_path / "rings", tmp_path / "megascan"
    run(Simulation(world_size=8, tp=2, pp=2, steps=12, compute_us=2000, ranks_per_node=4,
                   faults=Faults(slow_rank=5, slowdown=0.3)), rings, log=lambda _m: None)  # fmt: skip
    trace = load_path(rings, layout=Layout(2, 2, 8))
    write_traces(trace, traces, microbatches=2)
    megascan = load_path(traces)
    findings = analyze(megascan)["findings"]
    assert findings and findings[0]["ranks"] == [5] and {r for f in findings for r in f["ranks"]} == {5}, findings
    by_spans, _ = detect_span_stragglers(megascan)
    assert [f.ranks for f in by_spans] == [[5]]
