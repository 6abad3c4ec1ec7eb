"""PyTorch flight-recorder dumps: JSON and pickle, hangs told apart from stuck ranks, hostile pickles refused."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from rankwatch.analysis.analyze import analyze
from rankwatch.analysis.trace import load_path

T0 = 1_700_000_000_000_000_000


def dump(rank: int, last_seq: int, last_state: str, ranks_as_text: bool = False) -> dict:
    ranks = [0, 1, 2, 3]
    entries = []
    for seq in range(1, last_seq + 1):
        state = last_state if seq == last_seq else "completed"
        created = T0 + seq * 10_000_000 + rank * 1000
        entries.append({
            "record_id": seq, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": "nccl:all_reduce", "input_sizes": [[1024, 4]],
            "input_dtypes": ["Float"], "output_sizes": [[1024, 4]], "output_dtypes": ["Float"], "state": state,
            "time_created_ns": created,
            "time_discovered_started_ns": created + 100 if state in ("started", "completed") else None,
            "time_discovered_completed_ns": created + 5_000_000 if state == "completed" else None,
            "duration_ms": 5.0 if state == "completed" else None, "timeout_ms": 600000, "retired": state == "completed",
            "is_p2p": False, "frames": [],
        })  # fmt: skip
    return {
        "version": "2.10",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": str(ranks) if ranks_as_text else ranks}},
        "pg_status": {},
        "entries": entries,
    }


def write(directory, rank: int, content: dict, as_pickle: bool) -> None:
    path = directory / f"nccl_trace_rank_{rank}"
    path.write_bytes(pickle.dumps(content) if as_pickle else json.dumps(content).encode())


@pytest.mark.parametrize("as_pickle", [False, True])
def test_rank_whose_kernel_never_started_is_the_culprit(tmp_path, as_pickle):
    for rank in range(4):
        write(tmp_path, rank, dump(rank, 6, "scheduled" if rank == 2 else "started", ranks_as_text=True), as_pickle)
    document = analyze(load_path(tmp_path))
    [hang] = document["findings"]
    assert hang["ranks"] == [2] and hang["confidence"] >= 0.9
    assert "GPU work never started" in hang["summary"]


def test_rank_that_never_reached_the_collective_is_the_culprit(tmp_path):
    for rank in range(4):
        write(tmp_path, rank, dump(rank, 5 if rank == 3 else 6, "completed" if rank == 3 else "started"), False)
    [hang] = analyze(load_path(tmp_path))["findings"]
    assert hang["ranks"] == [3] and hang["evidence"]["waiting_ranks"] == [0, 1, 2]


def test_healthy_dumps_have_no_finding(tmp_path):
    for rank in range(4):
        write(tmp_path, rank, dump(rank, 6, "completed"), True)
    assert analyze(load_path(tmp_path))["healthy"] is True


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_pickle_is_refused_without_running_anything(tmp_path):
    marker = tmp_path / "pwned"
    for rank in range(3):
        write(tmp_path, rank, dump(rank, 6, "started"), True)
    hostile = dump(3, 6, "started")
    hostile["entries"][0]["frames"] = [Exploit(marker)]
    (tmp_path / "nccl_trace_rank_3").write_bytes(pickle.dumps(hostile))
    trace = load_path(tmp_path)
    assert not marker.exists()
    assert len(trace.problems) == 1 and "refused to load" in trace.problems[0] and "system" in trace.problems[0]
    assert sorted(trace.ranks) == [0, 1, 2], "the other ranks are still read"


def test_garbage_and_truncated_dumps_are_problems_not_crashes(tmp_path):
    write(tmp_path, 0, dump(0, 3, "completed"), False)
    (tmp_path / "nccl_trace_rank_1").write_bytes(b"\x80\x04garbage")
    (tmp_path / "nccl_trace_rank_2").write_text('{"entries": [')
    (tmp_path / "nccl_trace_rank_3").write_text('{"version": "2.10"}')
    trace = load_path(tmp_path)
    assert list(trace.ranks) == [0]
    text = "\n".join(trace.problems)
    assert "nccl_trace_rank_1: not a readable flight-recorder pickle" in text
    assert "nccl_trace_rank_2: line 1: not valid JSON" in text
    assert "nccl_trace_rank_3: no 'entries' list" in text
