"""`rankwatch analyze` as a ticket quotes it: a verdict only on input read whole, a non-zero exit and a
one-line reason when nothing or part of it was read, the layout checked against the traces, fixed UTC
times, the cause in every format, ``-`` for standard output. The traces are real `rankwatch simulate` runs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from html import escape

import pytest

from rankwatch.standins.simulate import Faults, Simulation, run

UTC_TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} UTC"


@pytest.fixture(scope="module")
def hang_run(tmp_path_factory):
    """8 ranks (TP 2, 4 per node) whose rank 3 stops before its 30th NCCL call."""
    directory = tmp_path_factory.mktemp("hang")
    run(
        Simulation(device="sync", gpu_timing=False, world_size=8, tp=2, steps=20, compute_us=500, ranks_per_node=4,
                   faults=Faults(hang_rank=3, hang_at=30)),
        directory,
    )  # fmt: skip
    return directory


def analyze(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rankwatch", "analyze", *map(str, args)], capture_output=True, text=True, timeout=300
    )


def one_line_reason(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_an_empty_directory_exits_non_zero_saying_so(tmp_path):
    result = analyze(tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert "no *.ring files" in one_line_reason(result)


def test_a_directory_of_corrupt_rings_is_inconclusive_never_healthy(tmp_path):
    for index in range(3):
        (tmp_path / f"rank-{index}.ring").write_bytes(bytes(range(256)) * 40)
    out = tmp_path / "report.json"
    result = analyze(tmp_path, "--json", out)
    assert result.returncode == 2
    reason = one_line_reason(result)
    assert reason.startswith("rankwatch analyze: inconclusive: no trace could be read; 3 input(s) skipped")
    assert "rank-0.ring" in reason and "not a rankwatch ring" in reason
    document = json.loads(out.read_text())
    assert document["healthy"] is False and document["inconclusive"] is True


def test_a_file_that_is_not_a_trace_is_inconclusive(tmp_path):
    other = tmp_path / "hostname"
    other.write_text("gpu-node-1\n")
    result = analyze(other)
    assert result.returncode == 2
    assert "inconclusive: no trace could be read" in one_line_reason(result)
    assert "healthy" not in result.stdout


def test_a_world_size_the_ring_headers_contradict_is_refused(hang_run):
    result = analyze(hang_run, "--world-size", 16)
    assert result.returncode == 2
    assert one_line_reason(result) == (
        "rankwatch analyze: --world-size 16 disagrees with the traces: their ring headers say world size 8"
    )
    result = analyze(hang_run, "--tp", 4, "--world-size", 8)
    assert result.returncode == 2 and "simulation.json says TP 2, PP 1" in one_line_reason(result)


def test_a_world_size_beyond_traces_that_do_not_record_it_flags_the_missing_ranks(hang_run, tmp_path):
    from rankwatch.analysis.load import load_path
    from rankwatch.analysis.megatrace import write_logs

    write_logs(load_path(hang_run), tmp_path)  # Megatrace logs: no world size in them
    result = analyze(tmp_path, "--world-size", 16)
    assert result.returncode == 1
    assert "INCONCLUSIVE: 8 of 16 ranks have no trace (ranks 8, 9, 10, 11, 12, 13, 14, 15)" in result.stdout
    assert analyze(tmp_path, "--world-size", 8).returncode == 0


def test_a_flight_recorder_dump_missing_from_its_process_groups_is_inconclusive(hang_run, tmp_path):
    from rankwatch.analysis.flight_recorder import write_dumps
    from rankwatch.analysis.load import load_path

    dumps = write_dumps(load_path(hang_run), tmp_path)
    assert analyze(tmp_path).returncode == 0, "every rank's dump"
    [dump_of_rank_5] = [path for path in dumps if path.name.endswith("rank_5")]
    dump_of_rank_5.unlink()
    result = analyze(tmp_path)
    assert result.returncode == 1
    assert "INCONCLUSIVE: 1 member(s) of the communicators have no trace (rank 5)" in result.stdout


def test_the_layout_is_read_from_the_traces_and_times_are_absolute(hang_run):
    result = analyze(hang_run)
    assert result.returncode == 0, result.stderr
    assert re.match(
        rf"8 ranks, \d+ NCCL calls, \d+ communicators, {UTC_TIME} to {UTC_TIME}$", result.stdout.split("\n")[0]
    )
    hang = next(line for line in result.stdout.splitlines() if line.startswith("HANG"))
    assert "rank 3 (tp 1, dp 1, pp 0) on node sim-node-0" in hang, "coordinates from simulation.json"
    assert re.search(rf"its last NCCL call was Allreduce #\d+, at {UTC_TIME}, [\d.]+ s before {UTC_TIME}", hang)
    assert " ago" not in result.stdout


def test_a_missing_rank_makes_the_analysis_inconclusive(hang_run, tmp_path):
    rings = sorted(hang_run.glob("*.ring"))
    for ring in rings[1:]:
        shutil.copy(ring, tmp_path)
    result = analyze(tmp_path, "--json", "-")
    assert result.returncode == 1
    document = json.loads(result.stdout)  # the JSON alone on standard output: `-` is not a file name
    assert not (tmp_path / "-").exists()
    assert document["healthy"] is False and document["inconclusive"] is True
    assert document["coverage"]["missing_ranks"] == [0] and document["coverage"]["world_size"] == 8
    assert "INCONCLUSIVE: 1 of 8 ranks have no trace (rank 0)" in result.stderr, "the summary moves to stderr"
    assert (
        result.stderr.strip().splitlines()[-1] == "rankwatch analyze: inconclusive: 1 of 8 ranks have no trace (rank 0)"
    )


def test_a_stray_unreadable_file_beside_every_rank_is_only_a_warning(hang_run, tmp_path):
    for ring in hang_run.glob("*.ring"):
        shutil.copy(ring, tmp_path)
    (tmp_path / "stray.ring").write_bytes(b"not a ring" * 500)
    result = analyze(tmp_path)
    assert result.returncode == 0, result.stderr
    assert "warning:" in result.stdout and "stray.ring" in result.stdout and "HANG" in result.stdout


def test_the_cause_is_in_every_format(hang_run, tmp_path):
    html, timeline = tmp_path / "report.html", tmp_path / "timeline.json"
    result = analyze(hang_run, "--html", html, "--chrome-trace", timeline, "--json", "-")
    assert result.returncode == 0, result.stderr
    [finding] = json.loads(result.stdout)["findings"]
    assert finding["cause"] == "unknown" and finding["cause_evidence"]
    assert f"cause unknown: {finding['cause_evidence']}" in result.stderr
    assert escape(f"cause unknown: {finding['cause_evidence']}") in html.read_text()
    [marker] = [e for e in json.loads(timeline.read_text())["traceEvents"] if e["ph"] == "i"]
    assert marker["args"]["cause"] == "unknown" and marker["args"]["cause_evidence"] == finding["cause_evidence"]
    result = analyze(hang_run, "--html", "-", "--json", "-")
    assert result.returncode == 2 and "only one of --json, --chrome-trace, --html can be -" in one_line_reason(result)


def test_megatrace_logs_that_end_are_a_hang_only_when_the_job_was_seen_hung_after_them(hang_run, tmp_path):
    """Logs alone end where they were cut (no hang); the user who saw the job hung says so, and rank 3,
    silent since its 30th call, is the hang's culprit."""
    from rankwatch.analysis.load import load_path
    from rankwatch.analysis.megatrace import write_logs

    write_logs(load_path(hang_run), tmp_path)
    assert "HANG" not in analyze(tmp_path).stdout
    seen = analyze(tmp_path, "--seen-until", "now")
    assert seen.returncode == 0 and "HANG" in seen.stdout, seen.stdout
    assert "rank 3 " in seen.stdout.split("HANG", 1)[1].splitlines()[0], seen.stdout
    bad = analyze(tmp_path, "--seen-until", "yesterday")
    assert bad.returncode == 2 and one_line_reason(bad).startswith("rankwatch analyze: --seen-until yesterday:")
