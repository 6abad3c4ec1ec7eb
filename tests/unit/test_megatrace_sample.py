"""Megatrace's own published sample: trace/analysis/logs/log_rank2_slow in github.com/sii-research/Megatrace
(8 ranks, TP 2, PP 4, early format without groupHash; its config.yaml two folders up).

The repository carries no licence, so its logs are not part of rankwatch: point
RANKWATCH_MEGATRACE_SAMPLE at a copy of log_rank2_slow to run this test (the config.yaml is looked up
at ../../config.yaml from there, or in RANKWATCH_MEGATRACE_CONFIG).

In those logs rank 2 arrives after its TP partner (rank 3) by several milliseconds for about half a
minute; the ranks of the next and previous stages it feeds (4 and 0) are late with it, by less; and
rank 7's log ends before the last AllGather the others enter, 0.4 ms before the logs end: the logs simply
end there, which is no hang.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rankwatch.analysis.analyze import analyze
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
    trace.layout = layout
    document = analyze(trace)
    assert [(f["kind"], f["ranks"]) for f in document["findings"]] == [("straggler", [2])], document["findings"]
    window = document["findings"][0]["evidence"]["late_window"]
    assert window["seconds"] >= 20 and window["median_late_ms"] >= 1.5, window
    assert any("rank 4" in p and "passed on" in p for p in document["problems"]), document["problems"]
    assert any("matched into" in p for p in document["problems"]), "the communicators were inferred, and it says so"


def test_logs_that_simply_end_are_no_hang():
    """Rank 7's log ends one call short of the others', 0.4 ms before the logs end: less than the stall
    threshold, said as such (was: a HANG of rank 7 waiting 40,264,397 s, timed against the wall clock)."""
    sample = Path(SAMPLE)
    layout = load_config(Path(os.environ.get("RANKWATCH_MEGATRACE_CONFIG", sample.parent.parent / "config.yaml")))
    trace = load_path(sample, layout=layout)
    trace.layout = layout
    document = analyze(trace, "hang")
    assert document["findings"] == [], document["findings"]
    assert any("rank 7's records end 1 call(s) short" in p and "not a hang" in p for p in document["problems"])
