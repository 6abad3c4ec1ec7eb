"""Slow pipeline links in dumps real PyTorch wrote (gloo; tests/analysis/gloo/README.md): gloo's flight
recorder keeps no send or receive, so the link shows only in when its two ends call their collectives.
Kept as files, so the decision is checked on the same bytes every time."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankwatch.analysis.analyze import analyze
from rankwatch.analysis.load import load_path
from rankwatch.analysis.topology import Layout

ARCHIVE = Path(__file__).parent / "gloo" / "slowlink.tar.xz"


@pytest.fixture(scope="module")
def runs(unpacked) -> Path:
    return unpacked(ARCHIVE)


def report(runs: Path, run: str, world: int, tp: int, pp: int) -> dict:
    layout = Layout(tp, pp, world)
    trace = load_path(runs / run, layout=layout)
    return analyze(trace)


@pytest.mark.parametrize(
    ("run", "world", "tp", "pp", "link"),
    [("torch-2.15.0-slowlink-1", 8, 4, 2, [1, 5]), ("torch-2.15.0-slowlink-5", 8, 2, 2, [2, 6])],
)
def test_a_late_pipeline_link_is_named_by_its_two_ends_alone(runs, run, world, tp, pp, link):
    """Every transfer between the two ranks arrived one microbatch's compute late. Each end is late at
    its next collectives where it receives over the link (the downstream end in the forward pass, the
    upstream end in the backward pass) while the other end is on time there. Was: "2 ranks stand out
    of the job, none alone: not localisable"; with TP 2 DP 2 the ends' TP peers, whose sends block on
    the late ends, showed the same pattern against the other replica's ranks."""
    document = report(runs, run, world, tp, pp)
    [finding] = document["findings"]
    assert finding["kind"] == "slow_link" and finding["ranks"] == link, document["findings"]
    evidence = finding["evidence"]
    for end in ("upstream", "downstream"):
        assert evidence[f"{end}_positions"], evidence
        for numbers in evidence[f"{end}_positions"].values():  # the job's own noise decided, by this much
            assert numbers["z"] >= evidence[f"{end}_z_needed"] > 3
            assert numbers["z_against_neighbour"] >= evidence[f"{end}_z_needed"]
    assert set(evidence["upstream_positions"]).isdisjoint(evidence["downstream_positions"])


def test_a_job_whose_dumps_came_late_after_its_last_collective_did_not_hang_there(runs):
    """16 ranks wrote their dumps (pickle, with stack traces, on a busy machine) 17-20 s after the job's
    last world all-reduce, whose 20 s timeout they all entered; rank 6's dump came before its work was
    retired. That is no timeout: a timeout fires a whole timeout after the call (was: a hang of all 16
    ranks in that all-reduce, and the link's pipeline compared no further)."""
    document = report(runs, "torch-2.8.0-slowlink-2", 16, 2, 4)
    assert [(f["kind"], f["ranks"]) for f in document["findings"]] == [("slow_link", [2, 6])], document["findings"]
