"""Megatrace's own published sample: trace/analysis/logs/log_rank2_slow in github.com/sii-research/Megatrace
(8 ranks, TP 2, PP 4, early format without groupHash; its config.yaml two folders up).

The repository carries no licence, so its logs are not part of rankwatch: point
RANKWATCH_MEGATRACE_SAMPLE at a copy of log_rank2_slow to run this test (the config.yaml is looked up
at ../../config.yaml from there, or in RANKWATCH_MEGATRACE_CONFIG).

In those logs rank 2 arrives after its TP partner (rank 3) by several milliseconds for about half a
minute; the ranks of the next and previous stages it feeds (4 and 0) are late with it, by less; and
rank 7's log ends before the last AllGather the others enter, 0.4 ms before the logs end: the logs simply
end there, which is no hang.

Why the last dumps are no stall evidence: Megatrace writes its ring out when no NCCL call came for
NCCL_MEGATRACE_SENSTIME (3 s by default), so every rank's last dump (its highest ``save_count``) says
only that the rank made no call for 3 s after its last one: true of every rank of a job that ended, was
killed or hung, alike, and the lines carry no time of the dump. Reading them as a stall would make
every set of logs a hang of whichever rank is one call short when they end (here rank 7, 0.4 ms before
the others stop). So a stall must show in the records themselves (peers logging on past the rank's last
call by the stall threshold) or come from the user (``--seen-until``: the job was seen hung then).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rankwatch.analysis.analyze import analyze, analyze_trace
from rankwatch.analysis.load import load_path
from rankwatch.analysis.topology import load_config

SAMPLE = os.environ.get("RANKWATCH_MEGATRACE_SAMPLE")
pytestmark = pytest.mark.skipif(
    not SAMPLE, reason="RANKWATCH_MEGATRACE_SAMPLE (a copy of Megatrace's log_rank2_slow; not redistributable) unset"
)


def test_rank_2_is_named_with_the_window_of_its_lateness():
    sample = Path(SAMPLE)
    config = Path(os.environ.get("RANKWATCH_MEGATRACE_CONFIG", sample.parent.parent / "config.yaml"))
    layout = load_config(config)
    assert (layout.tp, layout.pp, layout.world_size) == (2, 4, 8)
    trace = load_path(sample, layout=layout)
    document = analyze(trace)
    assert [(f["kind"], f["ranks"]) for f in document["findings"]] == [("straggler", [2])], document["findings"]
    window = document["findings"][0]["evidence"]["late_window"]
    assert window["seconds"] >= 20 and window["median_late_ms"] >= 1.5, window
    assert any("rank 4" in p and "passed on" in p for p in document["problems"]), document["problems"]
    assert any("matched into" in p for p in document["problems"]), "the communicators were inferred, and it says so"


def test_rankwatch_analyze_names_rank_2_and_no_other_rank():
    """As a user runs it (Megatrace's own --config-path): rank 2 first, with the window and size of its
    lateness and how far that stands out of the job's own host noise; no finding names any other rank
    (problem lines may say that rank 7's log ends one call short: that is no finding)."""
    sample = Path(SAMPLE)
    config = Path(os.environ.get("RANKWATCH_MEGATRACE_CONFIG", sample.parent.parent / "config.yaml"))
    result = subprocess.run(
        [sys.executable, "-m", "rankwatch", "analyze", str(sample), "--config-path", str(config), "--json", "-"],
        capture_output=True,
        text=True,
        check=True,
    )
    document = json.loads(result.stdout)
    named = {rank for finding in document["findings"] for rank in finding["ranks"]}
    assert named == {2}, document["findings"]
    first = document["findings"][0]
    assert (first["kind"], first["ranks"]) == ("straggler", [2])
    window = first["evidence"]["late_window"]
    assert 30 <= window["seconds"] <= 40 and 1.5 <= window["median_late_ms"] <= 3, window
    assert window["z"] >= window["z_needed"] and window["bins"] > window["longest_sibling_burst_bins"], window
    assert not any(finding["kind"] == "hang" for finding in document["findings"])


def test_logs_that_simply_end_are_no_hang():
    """Rank 7's log ends one call short of the others', 0.4 ms before the logs end: less than the stall
    threshold, said as such (was: a HANG of rank 7 waiting 40,264,397 s, timed against the wall clock)."""
    sample = Path(SAMPLE)
    layout = load_config(Path(os.environ.get("RANKWATCH_MEGATRACE_CONFIG", sample.parent.parent / "config.yaml")))
    trace = load_path(sample, layout=layout)
    document = analyze(trace, "hang")
    assert document["findings"] == [], document["findings"]
    assert any("rank 7's records end 1 call(s) short" in p and "not a hang" in p for p in document["problems"])


def test_a_job_seen_running_after_the_logs_end_is_a_hang_of_rank_7():
    """The stall Megatrace's idle dumps cannot give (see the module) comes from the user: judged at a time
    the job was seen still running, 10 s after the logs end, rank 7 (one call short) is the hang."""
    sample = Path(SAMPLE)
    layout = load_config(Path(os.environ.get("RANKWATCH_MEGATRACE_CONFIG", sample.parent.parent / "config.yaml")))
    trace = load_path(sample, layout=layout)
    seen = int(trace.calls["t_call"].max()) + 10_000_000_000
    trace.observed_until_ns = seen
    document = analyze_trace(trace, "hang", now_ns=seen).to_json()
    assert [(f["kind"], f["ranks"]) for f in document["findings"]][:1] == [("hang", [7])], document["findings"]
