"""Mismatched collectives and hangs that need a stall, on flight-recorder dumps and Megatrace logs
written as PyTorch and Megatrace write them."""

from __future__ import annotations

import json
import os

from rankwatch.analysis.analyze import analyze
from rankwatch.analysis.load import load_path

T0 = 1_700_000_000_000_000_000
FRAME = {"filename": "/job/train.py", "line": 0, "name": "train"}
TORCH_FRAME = {"filename": "/site-packages/torch/distributed/distributed_c10d.py", "line": 9, "name": "all_reduce"}


def entry(seq: int, rank: int, *, op="all_reduce", size=1024, dtype="Float", state="completed", line=10,
          group=("0", "default_pg"), retired=None, timeout_ms=600_000) -> dict:  # fmt: skip
    created = T0 + seq * 10_000_000 + rank * 1000
    done = state == "completed"
    return {
        "record_id": seq, "pg_id": int(group[0]) if group[0].isdigit() else 0, "process_group": group,
        "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": f"nccl:{op}",
        "input_sizes": [[size]], "input_dtypes": [dtype], "output_sizes": [[size]], "output_dtypes": [dtype],
        "state": state, "time_created_ns": created,
        "time_discovered_started_ns": created + 100 if state in ("started", "completed") else None,
        "time_discovered_completed_ns": created + 5_000_000 if done else None,
        "duration_ms": 5.0 if done else None, "timeout_ms": timeout_ms, "retired": done if retired is None else retired,
        "is_p2p": False, "frames": [TORCH_FRAME, {**FRAME, "line": line}],
    }  # fmt: skip


def write(directory, rank: int, entries: list[dict], groups: dict[str, list[int]] | None = None) -> None:
    groups = groups or {"0": [0, 1, 2, 3]}
    config = {name: {"name": name, "desc": "default_pg" if name == "0" else name, "ranks": ranks}
              for name, ranks in groups.items()}  # fmt: skip
    content = {"version": "2.10", "pg_config": config, "pg_status": {}, "entries": entries}
    (directory / f"nccl_trace_rank_{rank}").write_text(json.dumps(content))


def odd_call_at_6(directory, odd: int, **call) -> None:
    """Four ranks: five completed all-reduces, then at #6 rank ``odd`` makes another call; nobody completes it."""
    for rank in range(4):
        last = entry(6, rank, state="started", line=99 if rank == odd else 10, **(call if rank == odd else {}))
        write(directory, rank, [entry(seq, rank) for seq in range(1, 6)] + [last])


def test_the_minority_call_is_a_mismatch_with_its_frame_not_a_hang(tmp_path):
    odd_call_at_6(tmp_path, 2, op="broadcast")
    document = analyze(load_path(tmp_path))
    [finding] = document["findings"]
    assert (finding["kind"], finding["ranks"], finding["cause"]) == ("mismatch", [2], "software"), finding
    assert finding["evidence"]["mismatch"] == ["op"] and finding["evidence"]["decided_by"] == "majority"
    assert finding["evidence"]["culprit_frame"] == {"file": "/job/train.py", "line": 99, "function": "train"}
    assert "Broadcast" in finding["evidence"]["calls"]["2"] and "Allreduce" in finding["evidence"]["calls"]["0"]
    assert any("follows from the mismatched" in p for p in document["problems"]), "the hang it causes is explained"


def test_element_count_and_datatype_mismatches_say_what_differs(tmp_path):
    odd_call_at_6(tmp_path, 1, size=512)
    [count] = analyze(load_path(tmp_path))["findings"]
    assert (count["kind"], count["ranks"], count["evidence"]["mismatch"]) == ("mismatch", [1], ["count"])
    odd_call_at_6(tmp_path, 3, dtype="Double")
    [dtype] = analyze(load_path(tmp_path))["findings"]
    assert (dtype["kind"], dtype["ranks"], dtype["evidence"]["mismatch"]) == ("mismatch", [3], ["dtype"])
    assert "float64" in dtype["evidence"]["calls"]["3"]


def test_one_against_one_names_nobody_unless_sibling_groups_decide(tmp_path):
    """Two ranks disagree with no majority: nobody is named. With a second group of the same size that
    all-reduces at that number, the broadcast is the odd call."""
    pair = {"1": [0, 1]}
    for rank in range(2):
        calls = [entry(seq, rank, group=("1", "tp")) for seq in range(1, 4)]
        calls.append(entry(4, rank, group=("1", "tp"), state="started", op="broadcast" if rank else "all_reduce"))
        write(tmp_path, rank, calls, pair)
    [undecided] = analyze(load_path(tmp_path))["findings"]
    assert (undecided["kind"], undecided["ranks"], undecided["evidence"]["decided_by"]) == ("mismatch", [], "undecided")
    assert set(undecided["evidence"]["calls"]) == {"0", "1"}

    groups = {"1": [0, 1], "2": [2, 3]}
    for rank in range(2):
        write(tmp_path, rank, json.loads((tmp_path / f"nccl_trace_rank_{rank}").read_text())["entries"], groups)
    for rank in (2, 3):
        write(tmp_path, rank, [entry(seq, rank, group=("2", "tp")) for seq in range(1, 6)], groups)
    [decided] = analyze(load_path(tmp_path))["findings"]
    assert (decided["kind"], decided["ranks"], decided["evidence"]["decided_by"]) == ("mismatch", [1], "siblings")


def test_agreeing_ranks_have_no_mismatch_and_uneven_all_to_alls_are_no_mismatch(tmp_path):
    for rank in range(4):
        uneven = entry(7, rank, op="all_to_all", size=100 + rank)  # split sizes of its own: by design
        write(tmp_path, rank, [entry(seq, rank) for seq in range(1, 7)] + [uneven])
    assert analyze(load_path(tmp_path))["findings"] == []


def gloo_stop(directory, timeout_ms: int) -> None:
    """Gloo: every entry "scheduled"; rank 3 never entered #6, which the others' recorders retired when
    it timed out. The dumps' file times are old (copied without them): only the timeout tells the wait."""
    for rank in range(4):
        calls = [entry(seq, rank, state="scheduled", retired=True, timeout_ms=timeout_ms) for seq in range(1, 6)]
        if rank != 3:
            calls.append(entry(6, rank, state="scheduled", retired=True, timeout_ms=timeout_ms))
        write(directory, rank, calls)
        os.utime(directory / f"nccl_trace_rank_{rank}", ns=(T0, T0))


def test_a_timeout_that_ran_out_is_the_stall_that_makes_a_hang(tmp_path):
    gloo_stop(tmp_path, timeout_ms=8000)
    [hang] = analyze(load_path(tmp_path))["findings"]
    assert (hang["kind"], hang["ranks"]) == ("hang", [3]), hang
    assert 7.9 <= hang["evidence"]["waiting_seconds"] <= 8.1, "seconds, from the timeout: not the wall clock"


def test_a_wait_shorter_than_the_stall_threshold_is_no_hang(tmp_path):
    gloo_stop(tmp_path, timeout_ms=300)
    assert analyze(load_path(tmp_path), stall_seconds=1.0)["findings"] == []
    [hang] = analyze(load_path(tmp_path), stall_seconds=0.2)["findings"]
    assert hang["ranks"] == [3]


def megatrace_line(rank: int, t_ns: int, op: str, count: int, op_count: int, group: int) -> str:
    return (f"[save_count 1] [{t_ns // 10**9}.{t_ns % 10**9:09d}] [Rank {rank}] Fun {op} Data {count} stream 0x0 "
            f"opCount {op_count} groupHash {group}\n")  # fmt: skip


def megatrace_stop(directory, pair_goes_on_s: float) -> None:
    """Four ranks all-reduce in the world; rank 1 makes no 6th; ranks 2 and 3 go on all-reducing in
    their own group for ``pair_goes_on_s`` after it."""
    for rank in range(4):
        lines = [megatrace_line(rank, T0 + n * 10_000_000 + rank * 1000, "AllReduce", 1024, n, 111)
                 for n in range(6 if rank != 1 else 5)]  # fmt: skip
        if rank in (2, 3):
            steps = max(1, int(pair_goes_on_s / 0.1))
            lines += [megatrace_line(rank, T0 + 60_000_000 + int(k * pair_goes_on_s / steps * 1e9), "AllReduce", 8,
                                     k, 222) for k in range(steps + 1)]  # fmt: skip
        (directory / f"rank_{rank}.log").write_text("".join(lines))


def test_logs_that_simply_end_after_a_ranks_last_call_are_no_hang(tmp_path):
    megatrace_stop(tmp_path, pair_goes_on_s=0.0)
    document = analyze(load_path(tmp_path))
    assert not [f for f in document["findings"] if f["kind"] == "hang"], document["findings"]
    assert any("rank 1's records end 1 call(s) short" in p for p in document["problems"]), document["problems"]


def test_logs_that_run_on_past_the_stall_threshold_show_the_stopped_rank(tmp_path):
    megatrace_stop(tmp_path, pair_goes_on_s=5.0)
    [hang] = [f for f in analyze(load_path(tmp_path))["findings"] if f["kind"] == "hang"]
    assert hang["ranks"] == [1], hang
    assert 4.5 <= hang["evidence"]["waiting_seconds"] <= 5.5, "seconds: as long as the logs run on"


def test_rings_carry_op_count_and_datatype_a_mismatch_shows_in_them(tmp_path):
    """The tracer's rings record each call's op, count and datatype: one rank's TP all-reduce of
    another datatype (a code path of its own) is a mismatch naming it, and nobody else."""
    import numpy as np

    from rankwatch.analysis.load import load_path as load
    from rankwatch.standins.ring_writer import write_rings
    from rankwatch.standins.scenario import Scenario, generate

    run = generate(Scenario(16, tp=4, pp=2, steps=6))
    calls = run.trace.calls
    tp_comms = [c.id for c in run.trace.comms.values() if c.size == 4 and 6 in c.members.values()]
    odd = np.flatnonzero((calls["rank"] == 6) & np.isin(calls["comm"], tp_comms) & (calls["seq"] == 9))
    assert len(odd) == 1
    calls["dtype"][odd] = 9  # bfloat16 where its TP peers reduce float32
    write_rings(run.trace, tmp_path, parents=run.parents)
    findings = analyze(load(tmp_path))["findings"]
    mismatches = [f for f in findings if f["kind"] == "mismatch"]
    assert [(f["ranks"], f["evidence"]["mismatch"]) for f in mismatches] == [([6], ["dtype"])], findings
    assert findings == mismatches, "a healthy run otherwise: nothing else is named"


def pairs_with_a_lost_peer(directory, odd_also_at: int | None = None, configs: bool = True) -> None:
    """Four TP pairs all-reduce 1,024 floats; at #6 rank 6 all-reduces twice as many and its pair, rank 7,
    left no dump (gloo aborts a rank that receives more than it expects). ``odd_also_at``: rank 6's pair
    also makes its own call at that earlier number (a program of its own, as a last stage's loss).
    ``configs``: the dumps list the groups' ranks (gloo's leave them out)."""
    groups = {str(pair + 1): [2 * pair, 2 * pair + 1] for pair in range(4)} if configs else {"": [0]}
    for rank in range(7):
        group = (str(rank // 2 + 1), "tp")
        own = {"size": 8} if rank >= 6 else {}
        calls = [entry(seq, rank, group=group, **(own if seq == odd_also_at else {})) for seq in range(1, 6)]
        calls.append(entry(6, rank, group=group, state="started", **({"size": 2048} if rank == 6 else {})))
        write(directory, rank, calls, groups)


def test_an_odd_call_whose_peer_left_no_record_is_named_by_its_sibling_groups(tmp_path):
    pairs_with_a_lost_peer(tmp_path)
    document = analyze(load_path(tmp_path))
    finding = document["findings"][0]
    assert (finding["kind"], finding["ranks"], finding["cause"]) == ("mismatch", [6], "software"), document["findings"]
    evidence = finding["evidence"]
    assert (evidence["mismatch"], evidence["decided_by"], evidence["unrecorded"]) == (["count"], "siblings", [7])
    assert evidence["siblings_call"] == "Allreduce of 1,024 x float32" and "2,048" in evidence["calls"]["6"]
    assert not [f for f in document["findings"] if 7 in f["ranks"]], "the peer gloo aborted is not named"


def test_a_lone_call_of_a_group_with_a_program_of_its_own_is_no_mismatch(tmp_path):
    pairs_with_a_lost_peer(tmp_path, odd_also_at=3)
    document = analyze(load_path(tmp_path))
    assert not [f for f in document["findings"] if f["kind"] == "mismatch"], document["findings"]


def test_a_rank_alone_in_its_tp_group_is_not_taken_for_its_pipeline_group_of_one(tmp_path):
    """Gloo's dumps name no group's ranks and the layout completes them: with PP 1 rank 6 alone fits its
    pipeline group of one as well as its TP pair, but the job's other ranks are seen in TP pairs."""
    from rankwatch.analysis.topology import Layout

    pairs_with_a_lost_peer(tmp_path, configs=False)
    layout = Layout(2, 1, 8)
    trace = load_path(tmp_path, layout=layout)
    finding = analyze(trace)["findings"][0]
    assert (finding["kind"], finding["ranks"], finding["evidence"]["unrecorded"]) == ("mismatch", [6], [7]), finding
