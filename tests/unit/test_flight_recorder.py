"""PyTorch flight-recorder dumps: JSON and pickle, hangs told apart from stuck ranks, hostile pickles refused."""

from __future__ import annotations

import json
import os
import pickle
import zlib

import pytest

from rankwatch.analysis.analyze import analyze
from rankwatch.analysis.load import load_path

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
    [refused] = [problem for problem in trace.problems if "nccl_trace_rank_3" in problem]
    assert "refused to load" in refused and "system" in refused
    assert sorted(trace.ranks) == [0, 1, 2], "the other ranks are still read"


def test_garbage_and_truncated_dumps_are_problems_not_crashes(tmp_path):
    write(tmp_path, 0, dump(0, 3, "completed"), False)
    (tmp_path / "nccl_trace_rank_1").write_bytes(b"\x80\x04garbage")
    (tmp_path / "nccl_trace_rank_2").write_text('{"entries": [')
    (tmp_path / "nccl_trace_rank_3").write_text('{"version": "2.10", "comm_lib_version": ""}')
    trace = load_path(tmp_path)
    assert list(trace.ranks) == [0]
    text = "\n".join(trace.problems)
    assert "nccl_trace_rank_1: not a readable flight-recorder pickle" in text
    assert "nccl_trace_rank_2: line 1: not valid JSON" in text
    assert "nccl_trace_rank_3: no 'entries' list" in text


def test_json_dump_of_a_rank_that_recorded_nothing_is_read(tmp_path):
    """dump_json leaves "entries" out when there are none."""
    write(tmp_path, 0, dump(0, 3, "completed"), False)
    (tmp_path / "nccl_trace_rank_1").write_text('{"version": "2.10", "pg_config": {}, "pg_status": {}}')
    trace = load_path(tmp_path)
    assert sorted(trace.ranks) == [0, 1] and not [p for p in trace.problems if "rank_1" in p]


def test_older_dumps_with_one_sequence_number_and_text_status_are_read(tmp_path):
    """Dumps before collective_seq_id / p2p_seq_id had seq_id; JSON dumps write pg_status values as text."""
    for rank in range(4):
        content = dump(rank, 6, "completed")
        for entry in content["entries"]:
            entry["seq_id"] = entry.pop("collective_seq_id")
            del entry["p2p_seq_id"], entry["retired"]
        content["pg_status"] = {"0": {"last_enqueued_collective": "6", "last_completed_collective": "6"}}
        write(tmp_path, rank, content, False)
    trace = load_path(tmp_path)
    assert sorted(set(trace.calls["seq"].tolist())) == [1, 2, 3, 4, 5, 6]
    assert analyze(trace)["healthy"]


def test_memo_index_bomb_is_refused_before_unpickling(tmp_path):
    """LONG_BINPUT 2**31-1 would make the C unpickler size its memo to 16 GB."""
    write(tmp_path, 0, dump(0, 3, "completed"), True)
    bomb = b"\x80\x04}r\xff\xff\xff\x7f."  # EMPTY_DICT, LONG_BINPUT 0x7fffffff, STOP
    (tmp_path / "nccl_trace_rank_1").write_bytes(bomb)
    trace = load_path(tmp_path)
    [refused] = [problem for problem in trace.problems if "rank_1" in problem]
    assert "memo index 2147483647" in refused and "refused" in refused


def test_compression_bomb_is_refused(tmp_path, monkeypatch):
    from rankwatch.analysis import flight_recorder

    monkeypatch.setattr(flight_recorder, "MAX_DUMP_BYTES", 1 << 20)
    (tmp_path / "nccl_trace_rank_0").write_bytes(zlib.compress(b"{" + b" " * (8 << 20) + b"}", 9))
    trace = load_path(tmp_path)
    [refused] = trace.problems
    assert "inflates past 1 MiB" in refused


def test_compressed_dump_is_read(tmp_path):
    for rank in range(2):
        (tmp_path / f"nccl_trace_rank_{rank}").write_bytes(zlib.compress(pickle.dumps(dump(rank, 3, "completed"))))
    assert sorted(load_path(tmp_path).ranks) == [0, 1]


@pytest.mark.timeout(10)
def test_hostile_shape_costs_nothing_and_is_a_problem(tmp_path):
    """A million huge dimensions: math.prod would grind through a 60-million-bit product."""
    write(tmp_path, 0, dump(0, 3, "completed"), True)
    hostile = dump(1, 3, "completed")
    hostile["entries"][0]["input_sizes"] = [[2**62] * 1_000_000]
    write(tmp_path, 1, hostile, True)
    saturating = dump(2, 3, "completed")
    saturating["entries"][0]["input_sizes"] = [[2**40, 2**40, 2**40]]
    write(tmp_path, 2, saturating, True)
    trace = load_path(tmp_path)
    [problem] = [p for p in trace.problems if "rank_1" in p]
    assert "not a tensor shape" in problem
    assert int(trace.calls["count"][trace.calls["rank"] == 2].max()) == 2**63 - 1


def test_huge_rank_ids_are_problems_not_allocations(tmp_path):
    """A dump claiming rank 2^31 - 1, or a group of such ranks, once made the reader list every rank
    below it (two billion) as missing."""
    write(tmp_path, 0, dump(0, 3, "completed"), False)
    huge = dump(1, 3, "completed")
    huge["rank"] = 2**31 - 1
    (tmp_path / "nccl_trace_rank_1").write_text(json.dumps(huge))
    group = dump(2, 3, "completed")
    group["pg_config"]["0"]["ranks"] = [0, 1, 2**31 - 1]
    (tmp_path / "nccl_trace_rank_2").write_text(json.dumps(group))
    trace = load_path(tmp_path)
    assert list(trace.ranks) == [0]
    text = "\n".join(trace.problems)
    assert "nccl_trace_rank_1: rank 2147483647 is outside 0..1048575" in text
    assert "nccl_trace_rank_2: pg_config ranks" in text
