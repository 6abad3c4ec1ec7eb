"""Stragglers in dumps real PyTorch wrote on a busy machine (gloo; tests/analysis/gloo/README.md).
Kept as files, so the decision is checked on the same bytes every time."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankwatch.analysis.analyze import analyze
from rankwatch.analysis.load import load_path
from rankwatch.analysis.topology import Layout

ARCHIVE = Path(__file__).parent / "gloo" / "straggler-busy.tar.xz"


@pytest.fixture(scope="module")
def runs(unpacked) -> Path:
    return unpacked(ARCHIVE)


@pytest.mark.parametrize("run", ["torch-2.15.0-slow200-busy-1", "torch-2.15.0-slow200-busy-2"])
def test_a_straggler_is_told_from_the_pipeline_peer_waiting_for_it_step_by_step(runs, run):
    """Rank 1 (stage 0 of TP 1 PP 2) computes three times as long; rank 5, the next stage of its
    pipeline, waits for its activations in receives gloo does not record, so both stand out of the job
    (+94% and +91% in run 1). On a machine busy enough to spread the ranks by 5-9% the totals lie
    within that spread of each other, yet rank 1 was later than rank 5 in every step. Was: "2 ranks
    stand out of the job, none alone: not localisable"."""
    document = analyze(load_path(runs / run, layout=Layout(1, 2, 8)))
    [finding] = document["findings"]
    assert finding["kind"] == "straggler" and finding["ranks"] == [1], document["findings"]
    evidence = finding["evidence"]
    assert evidence["passed_on_to"] == [5], evidence
    assert evidence["z"] >= evidence["z_needed"] and evidence["p_value"] <= evidence["p_needed"]
