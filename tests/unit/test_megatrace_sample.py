"""Megatrace's own published sample: trace/analysis/logs/log_rank2_slow in github.com/sii-research/Megatrace
(8 ranks, TP 2, PP 4, early format without groupHash; its config.yaml two folders up).

The repository carries no licence, so its logs are not part of rankwatch: point
RANKWATCH_MEGATRACE_SAMPLE at a copy of log_rank2_slow to run this test (the config.yaml is looked up
at ../../config.yaml from there, or in RANKWATCH_MEGATRACE_CONFIG).

In those logs rank 2 arrives after its TP partner (rank 3) by several milliseconds for about half a
minute; the ranks of the next and previous stages it feeds (4 and 0) are late with it, by less; and
rank 7 never joins the last AllGather the others enter.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rankwatch.analysis.analyze import analyze
from rankwatch.analysis.topology import load_config
from rankwatch.analysis.trace import load_path

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
    stragglers = [f for f in document["findings"] if f["kind"] == "straggler"]
    assert [f["ranks"] for f in stragglers] == [[2]], document["findings"]
    window = stragglers[0]["evidence"]["late_window"]
    assert window["seconds"] >= 20 and window["median_late_ms"] >= 1.5, window
    assert any("rank 4" in p and "passed on" in p for p in document["problems"]), document["problems"]
    assert any("matched into" in p for p in document["problems"]), "the communicators were inferred, and it says so"
