"""A hang injected into a live run: a stall report reaches the collector within sensitivity + 2 s, and
the Megatrace logs written beside the rings let `rankwatch analyze` name the rank that stopped."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from rankwatch.analysis.ring import read_ring
from rankwatch.standins.simulate import Faults, Simulation, run

SENSITIVITY = 1.5


async def test_hang_is_reported_within_the_sensitivity_and_megatrace_logs_name_the_culprit(
    tmp_path, collector, make_sidecar
):
    traces = tmp_path / "traces"
    traces.mkdir()
    sidecar = await make_sidecar(traces, collector.url, window_s=1.0, poll_s=0.25, sensitivity_s=SENSITIVITY)
    stop = asyncio.Event()
    running = asyncio.create_task(sidecar.run(stop))
    culprit = 2
    simulation = Simulation(
        world_size=4, tp=2, pp=2, steps=50, compute_us=1000, ranks_per_node=4,
        faults=Faults(hang_rank=culprit, hang_at=30), settle=SENSITIVITY + 3,
    )  # fmt: skip
    outcomes = await asyncio.to_thread(run, simulation, traces)
    stop.set()
    await running
    assert all(o.exit_code is None for o in outcomes), "the hang held until the launcher stopped the ranks"

    assert collector.stalls, f"no stall report; answers {collector.answers}"
    culprit_ring = read_ring(next(o.ring for o in outcomes if o.rank == culprit))
    stopped_at = int(max(culprit_ring.records["t_call_ns"].max(), culprit_ring.records["t_return_ns"].max()))
    received, first = collector.stalls[0]
    assert received - stopped_at / 1e9 <= SENSITIVITY + 2.0, "reported within sensitivity + 2 s of the hang"
    assert first.sensitivity_s == SENSITIVITY and (first.namespace, first.job) == ("team-a", "llama")

    reports = [report for _, report in collector.stalls]
    kinds = {p.global_rank: p.stall for report in reports for p in report.positions if p.stall}
    assert kinds[culprit] == "silent", "the culprit stopped calling NCCL"
    waiting = {rank for rank, kind in kinds.items() if kind == "in_flight"}
    assert waiting and culprit not in waiting, kinds
    last = reports[-1]
    assert sorted(p.global_rank for p in last.positions) == [0, 1, 2, 3], "every local rank's position"
    for position in last.positions:
        if position.stall == "in_flight":
            comm = next(c for c in position.comms if c.in_flight)
            assert comm.oldest_in_flight_s >= SENSITIVITY and comm.oldest_in_flight_op in ("AllReduce", "Send", "Recv")
            assert comm.oldest_in_flight_seq is not None
    assert "made no NCCL call" in " ".join(r.summary for r in reports)

    megatrace = traces / "megatrace"
    assert last.megatrace_dir == str(megatrace)
    assert sorted(p.name for p in megatrace.glob("rank_*.log")) == [f"rank_{r}.log" for r in range(4)]
    result = subprocess.run(
        # logs that simply end are no hang; written at the stall, they were seen hung when written
        [sys.executable, "-m", "rankwatch", "analyze", "--log-path", str(megatrace), "--seen-until", "now"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "HANG" in result.stdout and f"rank {culprit}" in result.stdout.split("HANG", 1)[1].splitlines()[0], (
        result.stdout
    )


async def test_on_an_asynchronous_gpu_the_peers_collective_that_never_completes_is_the_stall(
    tmp_path, collector, make_sidecar
):
    """The peers' hosts ran ahead and blocked in a synchronisation; their GPUs started the collective the
    culprit never called and it never completes: that call, not a host wait, is what the report shows."""
    traces = tmp_path / "traces"
    traces.mkdir()
    sidecar = await make_sidecar(traces, collector.url, window_s=1.0, poll_s=0.25, sensitivity_s=SENSITIVITY)
    stop = asyncio.Event()
    running = asyncio.create_task(sidecar.run(stop))
    culprit = 2
    simulation = Simulation(
        world_size=4, tp=4, steps=400, compute_us=1000, ranks_per_node=4, device="async", gpu_timing=True,
        faults=Faults(hang_rank=culprit, hang_at=300), settle=SENSITIVITY + 3,
    )  # fmt: skip
    outcomes = await asyncio.to_thread(run, simulation, traces)
    stop.set()
    await running
    assert collector.stalls, f"no stall report; answers {collector.answers}"
    peer_ring = read_ring(next(o.ring for o in outcomes if o.rank == 0))
    started = int(peer_ring.records["gpu_start_ns"].max())  # the GPU start of the call that never ends
    received, _ = collector.stalls[0]
    assert received - started / 1e9 <= SENSITIVITY + 2.0, "reported within sensitivity + 2 s of the hang"
    kinds = {p.global_rank: p.stall for _, report in collector.stalls for p in report.positions if p.stall}
    assert {rank for rank, kind in kinds.items() if kind == "in_flight"} == {0, 1, 3}, kinds
    assert kinds[culprit] == "silent"
