"""rankwatch on flight-recorder dumps real PyTorch wrote: torch.distributed on gloo under torchrun, in
Megatron's layout (TP 2, PP 2, DP 2: TP all-reduces, PP send/recv, DP and world all-reduces).

What those dumps hold (PyTorch 2.15, gloo): every entry "scheduled" with no discovered times, ``retired``
when the work ended (also by timing out), an empty-named ``pg_config``, ``pg_status`` per pg id, no
send/recv entries, Python frames. The same runs again as NCCL would have recorded them (nccl_style.py):
completed/started states, discovery times, GPU durations, send/recv entries, real ``pg_config``.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from nccl_style import derive
from torchrun import LAYOUT, MISMATCH_RANK, SLOW_RANK, STOPPED_RANK

from rankwatch.analysis.analyze import analyze
from rankwatch.analysis.load import load_path
from rankwatch.analysis.topology import Layout

MEGATRON = Layout(LAYOUT["tp"], LAYOUT["pp"], LAYOUT["world"])


def findings_of(directory: Path, layout: Layout | None = MEGATRON) -> dict:
    trace = load_path(directory, layout=layout)
    return analyze(trace)


@pytest.fixture(params=["gloo", "nccl-style"])
def dumps_of(request, tmp_path):
    """The run's dumps as gloo wrote them, or as NCCL would have."""

    def pick(run: Path) -> Path:
        return run if request.param == "gloo" else derive(run, tmp_path / "nccl")[0].parent

    return pick


def test_what_real_gloo_dumps_contain(healthy_run):
    dump = pickle.loads((healthy_run / "nccl_trace_rank_0").read_bytes())
    entries = dump["entries"]
    assert dump["version"] and entries and {e["profiling_name"] for e in entries} == {"gloo:all_reduce"}
    assert {e["state"] for e in entries} == {"scheduled"}, "gloo never marks an entry started or completed"
    assert not any(e["time_discovered_completed_ns"] for e in entries)
    assert not any(e["is_p2p"] for e in entries), "gloo records no send/recv"
    assert all(e["frames"] for e in entries)


def test_healthy_job_has_no_finding(healthy_run, dumps_of):
    document = findings_of(dumps_of(healthy_run))
    assert document["healthy"], document["findings"]


def test_healthy_job_has_no_finding_without_a_layout(healthy_run):
    document = findings_of(healthy_run, layout=None)
    assert document["healthy"], document["findings"]


def test_healthy_json_dumps_have_no_finding(healthy_json_run):
    assert (healthy_json_run / "nccl_trace_rank_0").read_bytes()[:1] == b"{"
    document = findings_of(healthy_json_run)
    assert document["healthy"], document["findings"]


def test_slow_rank_is_the_one_straggler(slow_run, dumps_of):
    document = findings_of(dumps_of(slow_run))
    [finding] = document["findings"]
    assert finding["kind"] == "straggler" and finding["ranks"] == [SLOW_RANK], finding["summary"]
    assert finding["evidence"]["delay_ms"] > 5
    frame = finding["evidence"]["culprit_frame"]  # the training script's line, not torch's
    assert frame["file"].endswith("megatron_job.py") and frame["function"] == "train" and frame["line"] > 0


def test_stopped_rank_is_the_one_hang_culprit(stopped_run, dumps_of):
    directory = dumps_of(stopped_run)
    assert not (directory / f"nccl_trace_rank_{STOPPED_RANK}").exists(), "the stopped rank wrote no dump"
    document = findings_of(directory)
    [finding] = document["findings"]
    assert finding["kind"] == "hang" and finding["ranks"] == [STOPPED_RANK], finding["summary"]
    assert any(f"rank {STOPPED_RANK}" in problem for problem in document["problems"])
    if "waiting_frame" in finding["evidence"] or directory == stopped_run:  # gloo: the waiters' collectives
        frame = finding["evidence"]["waiting_frame"]  # where its peers wait: the stopped rank left no stack
        assert frame["file"].endswith("megatron_job.py") and frame["function"] == "train"


def test_without_a_layout_no_other_rank_is_blamed_for_the_stop(stopped_run):
    """Without the layout, gloo's unrecorded send/recv leave the waits of some ranks unexplained: rankwatch
    then names the rank without a dump when the recorded waits lead to it, and nobody otherwise."""
    document = findings_of(stopped_run, layout=None)
    assert [f["ranks"] for f in document["findings"]] in ([], [[STOPPED_RANK]]), document["findings"]
    assert any(f"rank {STOPPED_RANK}" in problem for problem in document["problems"])


def test_a_lost_dump_beside_the_stopped_ranks_names_nobody(stopped_run, dumps_of, tmp_path):
    """The stopped rank wrote no dump and a healthy rank's dump was lost too (its pod died before the
    dump was collected): both left no records, each is awaited, and the records cannot tell a stop from
    a loss. Naming either would cordon a healthy node half the time (was: the healthy one, alone)."""
    directory = tmp_path / "partial"
    directory.mkdir()
    lost = 0 if STOPPED_RANK else 1
    for dump in dumps_of(stopped_run).glob("nccl_trace_rank_*"):
        if dump.name != f"nccl_trace_rank_{lost}":
            (directory / dump.name).write_bytes(dump.read_bytes())
    document = findings_of(directory)
    assert [f["ranks"] for f in document["findings"]] == [[]], document["findings"]
    evidence = document["findings"][0]["evidence"]
    assert evidence["without_records"] == sorted([lost, STOPPED_RANK])
    assert {lost, STOPPED_RANK} <= set(evidence["candidates"])


def test_stopped_rank_that_dumps_too_is_the_one_culprit(stopped_all_dump_run, tmp_path):
    """Dump-on-timeout: every rank dumps, the stopped one too. Its dump ends a collective short of its
    TP peer's: as NCCL records it (sends and receives too) it is named, and nobody else."""
    assert (stopped_all_dump_run / f"nccl_trace_rank_{STOPPED_RANK}").exists()
    document = findings_of(derive(stopped_all_dump_run, tmp_path / "nccl")[0].parent)
    assert [(f["kind"], f["ranks"]) for f in document["findings"]] == [("hang", [STOPPED_RANK])], document["findings"]
    assert document["findings"][0]["evidence"]["waiting_seconds"] < 3600


def test_stopped_rank_that_dumps_too_on_gloo_names_no_healthy_rank(stopped_all_dump_run):
    """Gloo records no send/receive: the stopped rank and the pipeline neighbour blocked sending to it
    both look stopped; the report says the job stopped and names no healthy rank (was: healthy)."""
    document = findings_of(stopped_all_dump_run)
    [finding] = document["findings"]
    assert finding["kind"] == "hang" and finding["ranks"] in ([], [STOPPED_RANK]), finding
    if not finding["ranks"]:
        assert STOPPED_RANK in finding["evidence"]["candidates"]


def test_broadcast_where_the_peer_all_reduces_is_a_mismatch(broadcast_mismatch_run, dumps_of):
    """One against one in its TP group: the other TP groups all-reduce at that number, so the broadcast
    is the odd call; reported as a mismatch (software), not as a hang naming its healthy peer."""
    document = findings_of(dumps_of(broadcast_mismatch_run))
    [finding] = document["findings"]
    assert (finding["kind"], finding["ranks"], finding["cause"]) == ("mismatch", [MISMATCH_RANK], "software"), finding
    assert finding["evidence"]["mismatch"] == ["op"]
    frame = finding["evidence"]["culprit_frame"]
    assert frame["file"].endswith("megatron_job.py") and frame["function"] == "mismatched_call"


def test_all_reduce_of_another_element_count_is_a_mismatch(count_mismatch_run):
    """TP 4: gloo aborted the peer that received the larger chunk (no dump); the two peers that dumped
    agree against the odd rank. Nobody else is named, the aborted peer neither."""
    document = findings_of(count_mismatch_run, Layout(4, LAYOUT["pp"], LAYOUT["world"]))
    [finding] = document["findings"]
    assert (finding["kind"], finding["ranks"], finding["cause"]) == ("mismatch", [MISMATCH_RANK], "software"), finding
    assert finding["evidence"]["mismatch"] == ["count"]


def test_gpu_timed_slow_link_is_named(healthy_run, tmp_path):
    """NCCL's flight recorder holds sends/receives with GPU times: a link whose transfers take 0.5 ms
    longer once both sides are ready is named by its two ends, and nothing else."""
    sender, receiver = 1, 5  # tp 1, dp 0: stage 0 -> stage 1
    directory = derive(healthy_run, tmp_path / "nccl", slow_link=(sender, receiver), link_ns=500_000)[0].parent
    document = findings_of(directory)
    [finding] = document["findings"]
    assert finding["kind"] == "slow_link" and sorted(finding["ranks"]) == [sender, receiver], finding["summary"]
