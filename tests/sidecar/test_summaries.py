"""Window summaries from a live `rankwatch simulate` run reach a loopback collector with the rings' numbers."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import numpy as np

from rankwatch.analysis.ring import Op, read_ring
from rankwatch.standins.simulate import Simulation, run


async def test_summaries_of_a_live_run_carry_the_rings_numbers(
    tmp_path, collector, make_sidecar, ring_calls, summarised_calls
):
    traces = tmp_path / "traces"
    traces.mkdir()
    sidecar = await make_sidecar(traces, collector.url, window_s=0.3, poll_s=0.1)
    stop = asyncio.Event()
    running = asyncio.create_task(sidecar.run(stop))
    simulation = Simulation(world_size=4, tp=2, pp=2, steps=40, compute_us=2000, ranks_per_node=4, gpu_timing=True)
    await asyncio.to_thread(run, simulation, traces)
    await asyncio.sleep(0.4)  # the rings of the exited processes end at their next polls
    stop.set()
    await running

    summaries = collector.summaries
    assert len(summaries) >= 4, "several windows while the run was going"
    assert [s.window for s in summaries] == list(range(1, len(summaries) + 1))
    assert all(s.end_ns == t.start_ns for s, t in itertools.pairwise(summaries)), "windows abut"
    assert {(s.namespace, s.job, s.pod, s.expected_ranks) for s in summaries} == {
        ("team-a", "llama", "llama-worker-0", 4)
    }
    assert sum(s.dropped_summaries for s in summaries) == 0
    busy = [s for s in summaries if any(c.calls for r in s.ranks for c in r.comms)]
    assert len(busy) >= 3, "the calls were spread over the windows as they happened"

    assert summarised_calls(summaries) == ring_calls(traces), "every call counted once, by rank, communicator, op"

    for rank in range(4):
        rows = [(s, c) for s in summaries for r in s.ranks if r.global_rank == rank for c in r.comms]
        ring = read_ring(next(p for p in traces.glob("*.ring") if read_ring(p).header.global_rank == rank))
        for comm_id in {c.comm_id for _, c in rows}:
            windows = [c for _, c in rows if c.comm_id == comm_id]
            entered = [(c.first_entered, c.last_entered) for c in windows if c.first_entered is not None]
            completed = [(c.first_completed, c.last_completed) for c in windows if c.first_completed is not None]
            mine = ring.records[(ring.records["comm_id"] == int(comm_id, 16)) & (ring.records["op"] <= Op.RECV)]
            collectives = mine[(mine["op"] >= Op.ALLREDUCE) & (mine["op"] <= Op.SCATTER)]
            if not len(collectives):
                assert not entered, "send/recv numbers are per peer: no sequence range"
                continue
            top = int(collectives["seq"].max())
            for ranges in (entered, completed):
                assert ranges[0][0] == 1 and ranges[-1][1] == top
                assert all(b[0] == a[1] + 1 for a, b in itertools.pairwise(ranges)), "contiguous"
            finished = sum(c.wait.count for c in windows if c.wait)
            assert finished == len(mine) and all(c.in_flight == 0 for c in windows[-1:])
            waits = (mine["t_return_ns"] - mine["t_call_ns"]) / 1e9
            assert max(c.wait.max for c in windows if c.wait) == float(np.round(waits.max(), 9))
            assert sum(c.gap.count for c in windows if c.gap) == len(mine) - 1, "a gap between each pair of calls"
            timed = mine[mine["gpu_end_ns"] > 0]
            assert len(timed) and sum(c.gpu.count for c in windows if c.gpu) == len(timed), "GPU times when present"
        steps = [r.step_time_s for s in summaries for r in s.ranks if r.global_rank == rank and r.step_time_s]
        assert steps and 0.005 < float(np.median(steps)) < 1.0, steps

    # host interference: each live rank's scheduling from its second window on, the node's CPU pressure
    scheduled = [r.scheduling for s in summaries for r in s.ranks if r.scheduling is not None]
    assert len(scheduled) >= 4 and all(x.cpu_s >= 0 and x.run_delay_s >= 0 for x in scheduled)
    assert sum(x.cpu_s for x in scheduled) > 0, "the ranks ran"
    assert all(r.scheduling is None for r in summaries[0].ranks), "no window before the first reading"
    if Path("/proc/pressure/cpu").exists():
        assert all(0 <= s.cpu_pressure <= 1 for s in summaries[1:]) and summaries[0].cpu_pressure is None

    last = summaries[-1]
    assert last.ranks == [] or all(not r.alive for r in last.ranks), "the exited processes' rings ended"
