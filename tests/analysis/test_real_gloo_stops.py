"""Stopped and stuck ranks in dumps real PyTorch wrote (gloo; tests/analysis/gloo/README.md): runs the
real-run bench once got wrong (a healthy rank named, or a culprit the dumps prove left unnamed). Kept as
files, so the decision is checked on the same bytes every time rather than on whatever timing a new run
happens to get."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankwatch.analysis.analyze import analyze
from rankwatch.analysis.load import load_path
from rankwatch.analysis.topology import Layout

GLOO = Path(__file__).parent / "gloo"


@pytest.fixture(scope="module")
def runs(unpacked) -> Path:
    return unpacked(GLOO / "stops.tar.xz")


def findings(runs: Path, run: str, world: int, tp: int, pp: int) -> list[dict]:
    layout = Layout(tp, pp, world)
    trace = load_path(runs / run, layout=layout)
    return analyze(trace)["findings"]


@pytest.mark.parametrize(
    ("run", "world", "tp", "pp", "stopped"),
    [("torch-2.15.0-stop-nodump-2", 16, 4, 1, 9), ("torch-2.15.0-stop-nodump-4", 8, 2, 1, 3)],
)
def test_the_stopped_rank_is_named_though_its_peers_timeouts_retired_their_calls(runs, run, world, tp, pp, stopped):
    """Gloo retires a collective that timed out as it retires one that completed. The TP peers of the
    stopped rank that timed out first looked as if they had left their collective and stopped outside
    NCCL, and the ranks waiting for them in DP were blamed on them (was: [[11], [9]] and [[2]])."""
    assert [f["ranks"] for f in findings(runs, run, world, tp, pp)] == [[stopped]]


def test_lost_dumps_beside_the_stopped_rank_name_nobody(runs):
    """Ranks 3 and 5 lost their dumps, 7 stopped: each is awaited, and a lost dump looks like a stop
    (was: rank 3, healthy, alone)."""
    [finding] = findings(runs, "torch-2.8.0-stop-partial-0", 8, 2, 2)
    assert finding["ranks"] == [] and "not localisable" in finding["summary"]
    assert finding["evidence"]["without_records"] == [3, 5, 7]


def test_groups_completed_from_the_layout_with_tp_1(runs):
    """With TP 1 the layout's TPxDP groups are its DP groups: the group of two ranks whose peers lost
    their dumps was left at two, and they were named stuck inside it (was: [5, 6], healthy)."""
    named = [f["ranks"] for f in findings(runs, "torch-2.15.0-stop-partial-2", 8, 1, 2)]
    assert named == [[]], named


def test_a_stopped_rank_that_dumped_is_named(runs):
    """A collective that completed before a rank stopped outside NCCL stays completed: its peers went on."""
    assert [f["ranks"] for f in findings(runs, "torch-2.15.0-stop-dump-4", 8, 4, 2)] == [[2]]


def test_a_rank_stuck_inside_a_collective_is_named_alone(unpacked):
    """Rank 5's gloo workers of its TP group froze (megatron_job.py ``--stuck-rank 5 --stuck-step 2``): its
    TP all-reduce was recorded and never ran; its TP peer 4 timed out there and retired it, rank 5's
    stayed unretired a whole timeout later. Every rank dumped (was: ranks 4 and 5 both named "stuck",
    then a stop "not localisable")."""
    [finding] = findings(unpacked(GLOO / "stuck.tar.xz"), "torch-2.15.0-stuck-tp", 8, 2, 2)
    assert finding["kind"] == "hang" and finding["ranks"] == [5] and "stuck inside" in finding["summary"]


@pytest.fixture(scope="module")
def dumped_runs(unpacked) -> Path:
    """Stops where every rank dumped, the stopped one too (stop-dump.tar.xz)."""
    return unpacked(GLOO / "stop-dump.tar.xz")


@pytest.mark.parametrize(
    ("run", "world", "tp", "pp", "stopped"),
    [("torch-2.15.0-stop-dump-0", 16, 4, 2, 4), ("torch-2.8.0-stop-dump-2", 8, 2, 2, 1)],
)
def test_a_stopped_rank_is_told_from_a_tp_group_held_up_by_it(dumped_runs, run, world, tp, pp, stopped):
    """The stopped stage-0 rank's TP peers wait for it in their next all-reduce; the stage-1 TP group that
    waits (unrecorded) for its activations stopped all together at one completed all-reduce, nobody waiting:
    held up from outside, not stopped. Both are awaited by their DP peers (was: "not localisable", candidates
    4 and 12-15, and 1, 4 and 5)."""
    [finding] = findings(dumped_runs, run, world, tp, pp)
    assert finding["ranks"] == [stopped] and "stopped" in finding["summary"]


def test_a_stop_and_a_blocked_send_that_look_alike_name_nobody(dumped_runs):
    """Rank 13 (stage 1) stopped; rank 5 (stage 0) waits in its send to 13, which gloo does not record. Each
    is one all-reduce behind its own TP peers, who wait for it: a rank 5 that stopped after its all-reduce
    would leave the same dumps. Nobody is named."""
    [finding] = findings(dumped_runs, "torch-2.15.0-stop-dump-1", 16, 4, 2)
    assert finding["ranks"] == [] and "not localisable" in finding["summary"]
    assert finding["evidence"]["candidates"] == [5, 13]


def test_a_collective_nobody_left_names_nobody_when_no_work_ended(unpacked):
    """Rank 2's gloo workers of its DP group of two froze inside the all-reduce (``--stuck-rank 2``, TP 1 PP 4);
    rank 3 dumped as its own wait timed out, before its worker retired the work. Both members' work was still
    in flight in the dumps: nothing tells which one is stuck (was: ranks 2 and 3 both named stuck)."""
    [finding] = findings(unpacked(GLOO / "stuck-unretired.tar.xz"), "torch-2.15.0-stuck-dp2", 8, 1, 4)
    assert finding["ranks"] == [] and "not localisable" in finding["summary"]
    assert finding["evidence"]["members_inside"] == [2, 3]


@pytest.fixture(scope="module")
def partial_runs(unpacked) -> Path:
    """Stops where the stopped rank wrote no dump and other ranks' dumps were lost (stop-partial.tar.xz)."""
    return unpacked(GLOO / "stop-partial.tar.xz")


def test_a_stopped_rank_without_a_dump_is_placed_between_two_calls_by_its_peers(partial_runs):
    """Rank 3 stopped, 1's and 4's dumps were lost (TP 2, no pipeline). Rank 2, its only TP peer, waits in
    TP all-reduce #57 for it alone, and 2's call just before was world all-reduce #7, which every rank left:
    rank 3 left it too and never made the next call, with no send/receive to hold it. The lost ranks 1 and
    4 are awaited too, each beside another rank without a dump, and are not named (was: not localisable)."""
    [finding] = findings(partial_runs, "torch-2.8.0-stop-partial-21", 8, 2, 1)
    assert finding["ranks"] == [3] and "stopped" in finding["summary"]


def test_ranks_without_dumps_awaited_together_name_nobody(partial_runs):
    """Rank 2 stopped, 3's and 4's dumps were lost (TP 1, no pipeline): the five others wait in one DP
    all-reduce of eight for all three. Any of them may have stopped."""
    [finding] = findings(partial_runs, "torch-2.8.0-stop-partial-20", 8, 1, 1)
    assert finding["ranks"] == [] and "not localisable" in finding["summary"]
    assert finding["evidence"]["without_records"] == [2, 3, 4]
