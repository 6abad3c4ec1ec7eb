"""Megatrace NCCL-patch logs in both line formats, with overlapping dumps and bad lines, read with
each tokeniser (C, and numpy: its fallback); test_megatrace_tokenizers.py compares them."""

from __future__ import annotations

import numpy as np
import pytest

from rankwatch.analysis import megatrace
from rankwatch.analysis.analyze import analyze
from rankwatch.analysis.load import load_path
from rankwatch.analysis.megatrace import MegatraceError, read_logs
from rankwatch.analysis.ring import Op

NATIVE = megatrace._native


@pytest.fixture(autouse=True, params=["C", "numpy"])
def tokenizer(request, monkeypatch):
    """Every test here runs with each tokeniser."""
    if request.param == "numpy":
        monkeypatch.setattr(megatrace, "_native", None)
    elif NATIVE is None:
        pytest.fail("the C tokeniser (rankwatch.analysis._megatrace_tokenizer) is not built")
    assert megatrace.tokenizer() == request.param
    return request.param


NEW = "[save_count {s}] [100.{ns:09d}] [Rank {r}] Fun {op} Data 1024 stream 0x7f00 opCount {n} groupHash {g}\n"
OLD = "[save_count {s}] [100.{ns:09d}] [Rank {r}] Fun {op} Data 8 stream 0x{st:x} opCount {n}\n"


def test_new_format_with_overlapping_dumps(tmp_path):
    lines = [NEW.format(s=1, ns=i * 1000, r=0, op="AllReduce", n=i, g=-42) for i in range(5)]
    lines += [NEW.format(s=2, ns=i * 1000, r=0, op="AllReduce", n=i, g=-42) for i in range(3, 8)]  # overlaps 3, 4
    (tmp_path / "rank_0.log").write_text("".join(lines))
    (tmp_path / "rank_1.log").write_text(NEW.format(s=1, ns=0, r=1, op="Broadcast", n=0, g=-42))
    trace = read_logs(tmp_path)
    mine = trace.calls[trace.calls["rank"] == 0]
    assert mine["seq"].tolist() == list(range(1, 9)), "opCount 0.. becomes seq 1..; repeats kept once"
    assert (mine["op"] == Op.ALLREDUCE).all() and (mine["count"] == 1024).all()
    assert mine["t_call"][1] == 100 * 10**9 + 1000
    assert trace.has_returns is False
    assert int(np.int64(mine["comm"][0].astype(np.int64))) == -42, "groupHash (signed) names the communicator"
    assert set(trace.comms[int(mine["comm"][0])].members.values()) == {0, 1}


def test_old_format_keys_communicators_by_stream_never_across_ranks(tmp_path):
    (tmp_path / "rank_0.log").write_text(OLD.format(s=1, ns=0, r=0, op="AllReduce", st=0xA, n=0)
                                         + OLD.format(s=1, ns=5, r=0, op="Send", st=0xB, n=0))  # fmt: skip
    (tmp_path / "rank_1.log").write_text(OLD.format(s=1, ns=0, r=1, op="AllReduce", st=0xA, n=0))
    trace = read_logs(tmp_path)
    assert len(np.unique(trace.calls["comm"][trace.calls["rank"] == 0])) == 2
    assert not set(trace.calls["comm"][trace.calls["rank"] == 0]) & set(trace.calls["comm"][trace.calls["rank"] == 1])


def test_bad_line_names_file_and_line_and_other_ranks_survive(tmp_path):
    good = NEW.format(s=1, ns=0, r=0, op="AllReduce", n=0, g=7)
    (tmp_path / "rank_0.log").write_text(good)
    (tmp_path / "rank_1.log").write_text(good.replace("Rank 0", "Rank 1") + "garbage in the middle\n")
    trace = read_logs(tmp_path)
    assert list(trace.ranks) == [0]
    assert len(trace.problems) == 1 and "rank_1.log:2: not a Megatrace line" in trace.problems[0]


def test_unknown_operation_is_refused(tmp_path):
    (tmp_path / "rank_0.log").write_text(NEW.format(s=1, ns=0, r=0, op="Teleport", n=0, g=7))
    trace = read_logs(tmp_path)
    assert "unknown operation 'Teleport'" in trace.problems[0]


def test_empty_directory_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no rank_"):
        read_logs(tmp_path)
    assert MegatraceError


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (NEW.format(s=1, ns=0, r=0, op="AllReduce", n=0, g="12x"), "rank_0.log:1: not a Megatrace line"),
        (OLD.format(s=1, ns=0, r=0, op="AllReduce", n=0, st=0).replace("0x0", "0xZZ"), "rank_0.log:1: not a Megat"),
        (OLD.format(s=1, ns=0, r=0, op="AllReduce", n=0, st=2**68), "rank_0.log: a number does not fit in 64 bits"),
    ],
)
def test_bad_group_hash_or_stream_is_a_problem_not_a_crash(tmp_path, line, problem):
    (tmp_path / "rank_0.log").write_text(line)
    (tmp_path / "rank_1.log").write_text(NEW.format(s=1, ns=0, r=1, op="AllReduce", n=0, g=7))
    trace = read_logs(tmp_path)
    assert list(trace.ranks) == [1]
    assert len(trace.problems) == 1 and problem in trace.problems[0]


def test_a_log_naming_a_huge_rank_is_a_problem_not_an_allocation(tmp_path):
    """Rank 2,000,000,000 in a Megatrace log once made the analysis build per-rank lists that long
    (MemoryError); the log is skipped, naming why, and the others are analysed."""
    for rank in (0, 1, 2_000_000_000):
        lines = [f"[save_count {i}] [1700000000.00000000{i}] [Rank {rank}] Fun AllReduce Data 1024 stream 0x1 "
                 f"opCount {i}" for i in range(1, 6)]  # fmt: skip
        (tmp_path / f"rank_{rank}.log").write_text("\n".join(lines) + "\n")
    trace = load_path(tmp_path)
    assert sorted(trace.ranks) == [0, 1]
    assert any("rank 2000000000 is beyond the highest analysed" in problem for problem in trace.problems)
    analyze(trace)
