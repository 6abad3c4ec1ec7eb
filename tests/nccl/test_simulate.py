"""`rankwatch simulate`: a Megatron-shaped job traced end to end, with faults that show in the trace, on the
synchronous device (each call returns when its work is done: host waits are GPU waits). The asynchronous
device, the default, has its own tests in test_async_device.py."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from rankwatch.analysis.ring import Op, State, read_ring
from rankwatch.standins.simulate import Faults, Simulation, SimulationError, run

SYNC = {"device": "sync", "gpu_timing": False}


def load(out):
    meta = json.loads((out / "simulation.json").read_text())
    return meta, {r["rank"]: read_ring(r["ring"]).records for r in meta["ranks"]}


def wait_ns(records: np.ndarray) -> np.ndarray:
    return records["t_return_ns"] - records["t_call_ns"]


def test_megatron_run_records_every_call_of_every_rank(tmp_path):
    outcomes = run(Simulation(**SYNC, world_size=8, tp=2, pp=2, steps=4, compute_us=500, ranks_per_node=4), tmp_path)
    assert [o.exit_code for o in outcomes] == [0] * 8
    meta, rings = load(tmp_path)
    assert meta["ranks"][5]["node"] == "sim-node-1"
    for rank, records in rings.items():
        pp_rank = rank // 4
        ops = records["op"]
        # per step: 2 microbatches x (2 forward + 1 backward) TP AllReduce, 2 DP buckets, 1 world
        assert (ops == Op.ALLREDUCE).sum() == 4 * (6 + 2 + 1)
        assert (ops == Op.SEND).sum() == (ops == Op.RECV).sum() == 4 * 2
        assert (ops == Op.COMM_SPLIT).sum() == 2 and (ops == Op.COMM_INIT).sum() == 2
        sends = records[ops == Op.SEND]
        assert set(sends["peer"]) == {1 - pp_rank}, "PP peers, as ranks of the PP communicator"
        assert read_ring(meta["ranks"][rank]["ring"]).header.hostname == f"sim-node-{rank // 4}"
    tp_groups = {}
    for rank, records in rings.items():
        split_ids = records[records["op"] == Op.COMM_SPLIT]["comm_id"]
        tp_groups.setdefault(int(split_ids[0]), set()).add(rank)
    assert sorted(map(sorted, tp_groups.values())) == [[0, 1], [2, 3], [4, 5], [6, 7]], "Megatron order: tp fastest"


def test_slowed_rank_waits_least_in_its_collectives(tmp_path):
    slow = 5
    run(Simulation(**SYNC, world_size=8, tp=4, pp=1, steps=12, compute_us=3000,
                   faults=Faults(slow_rank=slow, slowdown=0.5)), tmp_path)  # fmt: skip
    _, rings = load(tmp_path)
    tp_peers = [4, 5, 6, 7]
    median_wait = {
        rank: float(
            np.median(wait_ns(rings[rank][(rings[rank]["op"] == Op.ALLREDUCE) & (rings[rank]["count"] == 4096)]))
        )
        for rank in tp_peers
    }
    assert min(median_wait, key=median_wait.get) == slow, median_wait
    others = [median_wait[r] for r in tp_peers if r != slow]
    # its peers wait for its extra compute (1.5 ms a step) on top of what every collective takes, which a
    # loaded machine stretches for all alike: a difference, not a ratio
    extra_ns = 0.5 * 3000 * 1000
    assert min(others) - median_wait[slow] > extra_ns / 2, f"the straggler arrives last and waits least: {median_wait}"


def test_hang_before_a_call_leaves_the_culprit_behind_its_peers(tmp_path):
    culprit = 3
    outcomes = run(Simulation(**SYNC, world_size=4, tp=4, steps=50, compute_us=500,
                              faults=Faults(hang_rank=culprit, hang_at=20)), tmp_path)  # fmt: skip
    assert all(o.exit_code is None for o in outcomes), "everyone is stuck and stopped by the launcher"
    _, rings = load(tmp_path)
    calls = {rank: records[records["op"] < Op.COMM_INIT] for rank, records in rings.items()}
    assert len(calls[culprit]) == 19 and (calls[culprit]["state"] != State.ENTERED).all()
    for rank in (0, 1, 2):
        assert len(calls[rank]) == 20, "the peers entered call 20 ..."
        assert calls[rank][-1]["state"] == State.ENTERED and calls[rank][-1]["t_return_ns"] == 0, "... and wait in it"


def test_stuck_call_is_entered_by_everyone_and_never_returns(tmp_path):
    run(
        Simulation(**SYNC, world_size=4, tp=4, steps=50, compute_us=500, faults=Faults(stuck_rank=2, stuck_at=10)),
        tmp_path,
    )
    _, rings = load(tmp_path)
    for records in rings.values():
        calls = records[records["op"] < Op.COMM_INIT]
        assert len(calls) == 10 and calls[-1]["state"] == State.ENTERED


ODD_CALLS = {  # what the odd rank calls where its peers all-reduce 4,096 x float32 (its first TP collective)
    "op": (Op.BROADCAST, 4096, 7),
    "count": (Op.ALLREDUCE, 2048, 7),
    "dtype": (Op.ALLREDUCE, 4096, 9),
}


@pytest.mark.parametrize("mismatch", sorted(ODD_CALLS))
def test_a_rank_calling_another_collective_than_its_peers_leaves_every_member_inside_it(tmp_path, mismatch):
    # as with the real NCCL: the members meet at the collective, disagree on what it is, and none completes
    odd = 2
    faults = Faults(mismatch_rank=odd, mismatch_at=1, mismatch=mismatch)
    outcomes = run(Simulation(**SYNC, world_size=4, tp=4, steps=50, compute_us=500, faults=faults), tmp_path)
    assert all(o.exit_code is None for o in outcomes), "everyone is stuck and stopped by the launcher"
    _, rings = load(tmp_path)
    for rank, records in rings.items():
        calls = records[records["op"] < Op.COMM_INIT]
        assert len(calls) == 1 and calls[0]["state"] == State.ENTERED, (rank, calls)
        recorded = (int(calls[0]["op"]), int(calls[0]["count"]), int(calls[0]["dtype"]))
        assert recorded == (ODD_CALLS[mismatch] if rank == odd else (Op.ALLREDUCE, 4096, 7)), (rank, recorded)
    assert "called different collectives" in (tmp_path / f"rank-{odd}.log").read_text()


def test_slow_link_delays_only_that_pair(tmp_path):
    run(Simulation(**SYNC, world_size=8, tp=2, pp=4, steps=6, compute_us=500,
                   faults=Faults(slow_link=(2, 4), link_latency_us=20000)), tmp_path)  # fmt: skip
    _, rings = load(tmp_path)

    def median_recv_wait(rank, peer_global):
        records = rings[rank]
        recvs = records[(records["op"] == Op.RECV) & (records["peer"] == (peer_global // 2))]
        return float(np.median(wait_ns(recvs)))

    assert median_recv_wait(4, 2) > 15e6, "rank 4 receives from rank 2 over the slow link"
    assert median_recv_wait(5, 3) < 10e6, "the neighbouring pair (3 -> 5) is not slowed"


def test_cli_reports_bad_layouts_clearly(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rankwatch", "simulate", "--world-size", "6", "--tp", "4", "--out", str(tmp_path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 1 and "--tp 4 x --pp 1 must divide --world-size 6" in result.stderr
    with pytest.raises(SimulationError, match="--slow-rank 9 is not a rank of a 4-rank job"):
        run(Simulation(world_size=4, faults=Faults(slow_rank=9, slowdown=0.1)), tmp_path)
    with pytest.raises(SimulationError, match="--mismatch 'size': choose one of op, count, dtype"):
        run(Simulation(world_size=4, faults=Faults(mismatch_rank=1, mismatch_at=3, mismatch="size")), tmp_path)
