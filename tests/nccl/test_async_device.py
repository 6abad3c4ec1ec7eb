"""The asynchronous stand-in device (RANKWATCH_STANDIN_DEVICE=async): the host runs ahead of its GPU.

Real processes on the stand-in libcuda.so.1 and libnccl.so.2, reached as PyTorch reaches them: an
NCCL call returns in microseconds while its collective completes later on the stream; the host
blocks only when it synchronises or its launch queue is full; CUDA events time the stream.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import numpy as np
import pytest

from rankwatch.analysis.analyze import analyze_trace
from rankwatch.analysis.load import load_path
from rankwatch.analysis.ring import Flag, Op, State, read_ring
from rankwatch.standins.simulate import Faults, HostCost, PodRun, Simulation, SimulationError, run, run_pod

ASYNC = {"RANKWATCH_STANDIN_DEVICE": "async"}
CUDA_SUCCESS, CUDA_ERROR_NOT_READY = 0, 600
# Beyond the error of the ring's GPU clock anchor (its header says how large): float milliseconds of
# cuEventElapsedTime and two clocks ticking at slightly different rates over a run of seconds
FLOAT_NS = 50_000


def test_nccl_call_returns_at_once_and_the_collective_completes_when_the_late_peer_arrives(run_ranks):
    early, late = run_ranks("run_ahead", 2, env=ASYNC)
    # in order of events (one machine, one realtime clock), not in milliseconds a loaded machine stretches
    assert early["returned_ns"] < late["called_ns"], "the call only enqueued the collective: back before the peer"
    assert early["query_after_call"] == CUDA_ERROR_NOT_READY, "the stream has not reached the event yet"
    assert early["synced_ns"] > late["called_ns"], "the host blocks in cuStreamSynchronize until rank 1 arrived"
    assert early["query_after_sync"] == CUDA_SUCCESS
    assert early["result"] == late["result"] == [3.0] * 4, "data moved on the executor, read after the sync"


def test_collectives_groups_splits_and_error_codes_work_on_the_asynchronous_device(run_ranks, tmp_path):
    """Every collective moves the right data (read after a synchronisation, as a tensor would be),
    grouped send/recv complete, split and shrink work, misuse gets NCCL's error codes at the call."""
    seen = run_ranks("basic", 4, trace_dir=tmp_path, env=ASYNC)
    assert [r["allreduce"] for r in seen] == [[10.0] * 4] * 4
    assert all(r["broadcast"] == [10.0, 10.0] and r["bcast"] == [200.0] for r in seen)
    assert seen[0]["reduce"] == [4.0] and seen[2]["allgather"] == [0.0, 1.0, 2.0, 3.0]
    assert seen[1]["reducescatter"] == [4.0] and seen[1]["alltoall"] == [1.0, 11.0, 21.0, 31.0]
    for path in tmp_path.glob("*.ring"):
        records = read_ring(path).records
        assert (records["result"] == 0).all() and (records["state"] == State.RETURNED).all()
        assert (records["op"] == Op.COMM_SPLIT).sum() == 1
    [clique] = run_ranks("init_all", 1, env=ASYNC)
    assert clique["sums"] == [[3.0], [3.0]], "one process, two devices, one group"
    for result in run_ranks("misuse", 2, env=ASYNC):
        codes = {key: value for key, value in result.items() if key not in ("rank", "stderr")}
        assert codes == {"root_out_of_range": 4, "send_to_self": 5, "bad_datatype": 4,
                         "group_end_without_start": 5, "use_after_destroy": 4}  # fmt: skip


def test_synchronous_device_keeps_the_call_blocking(run_ranks):
    early, late = run_ranks("run_ahead", 2, env={"RANKWATCH_STANDIN_DEVICE": "sync"})
    assert early["returned_ns"] > late["called_ns"], "sync: the call itself waits for the late peer"
    assert early["query_after_call"] == CUDA_SUCCESS
    assert early["result"] == [3.0] * 4


def test_host_runs_ahead_and_events_time_the_kernels(run_ranks):
    [seen] = run_ranks("kernels", 1, env=ASYNC)
    assert seen["query_while_running"] == CUDA_ERROR_NOT_READY
    assert seen["query_after_launches"] == CUDA_ERROR_NOT_READY, "20 kernels of 30 ms launched without waiting"
    # the end event follows the 100 ms kernel, not the 600 ms queued after it (a sleep runs long, never short)
    assert 99 <= seen["event_ms"] < 400, f"the events bracket the 100 ms kernel: {seen['event_ms']}"
    assert seen["ctx_sync_ms"] >= 550, "cuCtxSynchronize waits for the 600 ms of queued kernels"
    assert seen["stream_query_after"] == CUDA_SUCCESS


def test_a_full_launch_queue_blocks_the_host(run_ranks):
    env = {**ASYNC, "RANKWATCH_STANDIN_LAUNCH_QUEUE": "4", "KERNELS": "10", "KERNEL_NS": "30000000"}
    [seen] = run_ranks("kernels", 1, env=env)
    # queue of 4: the 100 ms kernel and its end event hold two places; the host waits until only
    # four items are pending, so at least ~100 + 6 x 30 ms pass before the tenth launch returns
    assert seen["launch_ms"] >= 250, seen
    [unbounded] = run_ranks("kernels", 1, env={**ASYNC, "KERNELS": "10", "KERNEL_NS": "30000000"})
    assert unbounded["query_after_launches"] == CUDA_ERROR_NOT_READY, "the default queue (1024) holds them all"


def test_slowed_device_runs_longer_kernels(run_ranks):
    [seen] = run_ranks("kernels", 1, env={**ASYNC, "RANKWATCH_STANDIN_SLOWDOWN": "0.5", "KERNELS": "0"})
    assert 148 <= seen["event_ms"] < 200, f"a 100 ms kernel takes 150 ms on the slowed GPU: {seen['event_ms']}"


def test_hung_peer_blocks_the_host_in_stream_synchronize_not_in_the_call(run_ranks):
    waiting, _ = run_ranks("hung_peer", 2, env=ASYNC)
    assert waiting["call_us"] < 1_500_000, "the NCCL call returned (rank 1 never calls)"
    assert waiting["sync_blocked_1_5_s"], "cuStreamSynchronize still blocked after 1.5 s"


def test_aborting_the_communicator_drains_the_stream(run_ranks):
    waiting, _ = run_ranks("abort", 2, env=ASYNC)
    assert waiting["pending_before_abort"] == CUDA_ERROR_NOT_READY, "the collective waits for rank 1"
    # rank 1 never calls: only the abort can have let the synchronisation return
    assert waiting["abort_result"] == 0 and "drained_ms" in waiting, "ncclCommAbort ends it"


def test_gpu_timing_measures_the_collective_on_the_stream(run_ranks, tmp_path):
    """The interposer's events give the GPU start (after the compute it waits for) and end (when the
    straggler joined): rank 0 starts 200 ms in and waits ~200 ms; rank 1 (400 ms kernel) waits least."""
    seen = run_ranks("ordered", 2, trace_dir=tmp_path, env={**ASYNC, "RANKWATCH_GPU_TIMING": "1"})
    assert all(r["result"] == [3.0] * 4 for r in seen)
    rings, slack = {}, {}
    for path in tmp_path.glob("*.ring"):
        snapshot = read_ring(path)
        rings[snapshot.header.global_rank] = snapshot.records
        slack[snapshot.header.global_rank] = snapshot.header.gpu_clock_error_ns + FLOAT_NS
    gpu_wait_ms = {}
    for rank, result in enumerate(seen):
        _, call = rings[rank][rings[rank]["op"] == Op.ALLREDUCE]
        assert call["flags"] & Flag.GPU_TIMED and call["state"] == State.GPU_DONE
        kernel_end_ns = result["launched_ns"] + result["kernel_ms"] * 1_000_000
        assert call["gpu_start_ns"] >= kernel_end_ns - slack[rank], "starts after the compute it waits for"
        assert call["gpu_start_ns"] - call["t_return_ns"] > 150_000_000, "long after the host call returned"
        gpu_wait_ms[rank] = (call["gpu_end_ns"] - call["gpu_start_ns"]) / 1e6
    # rank 1's compute is 200 ms longer: rank 0's collective waits those 200 ms (a sleep runs long, never
    # short, so the difference can only grow on a loaded machine), rank 1's barely at all
    assert gpu_wait_ms[0] - gpu_wait_ms[1] >= 150, f"rank 0 waits for the straggler on its GPU: {gpu_wait_ms}"


# ---- the Megatron-shaped driver on the asynchronous device ------------------------------------------------
def load(out: Path) -> tuple[dict, dict[int, np.ndarray]]:
    meta = json.loads((out / "simulation.json").read_text())
    rings = {r["rank"]: read_ring(r["ring"]).records for r in meta["ranks"]}
    return meta, {rank: records[records["op"] < Op.COMM_INIT] for rank, records in rings.items()}


def clock_slack(out: Path) -> dict[int, int]:
    """Per rank, how far its GPU times may be off against its host times: the tracer anchors the GPU
    clock within a window it measures (wide when the machine is loaded) and writes the error down."""
    meta = json.loads((out / "simulation.json").read_text())
    return {r["rank"]: read_ring(r["ring"]).header.gpu_clock_error_ns + FLOAT_NS for r in meta["ranks"]}


def test_megatron_driver_runs_ahead_of_its_gpu_between_synchronisations(tmp_path):
    run(Simulation(world_size=8, tp=2, pp=2, steps=4, compute_us=2000, gpu_timing=True, device="async"), tmp_path)
    _, calls = load(tmp_path)
    slack = clock_slack(tmp_path)
    for rank, records in calls.items():
        assert 0 < slack[rank] - FLOAT_NS < 1_000_000_000, f"rank {rank}: the tracer measured its clock anchor"
        assert (records["op"] == Op.ALLREDUCE).sum() == 4 * (6 + 2 + 1), f"rank {rank}: the same calls as sync"
        host_ms = (records["t_return_ns"] - records["t_call_ns"]) / 1e6
        timed = records[records["state"] == State.GPU_DONE]
        ahead_ms = (timed["gpu_end_ns"] - timed["t_return_ns"]) / 1e6
        assert np.median(host_ms) < 0.5, f"rank {rank}: calls return at once ({np.median(host_ms):.2f} ms)"
        assert np.median(ahead_ms) > 4, f"rank {rank}: the GPU finishes well after the call ({np.median(ahead_ms)} ms)"
        # the poller's last pass at exit completes what it had not reached yet
        assert len(timed) == len(records), f"rank {rank}: {len(timed)} of {len(records)} GPU-timed"
        # the grad norm's .item() each step: the host's next call comes after that AllReduce ended on the GPU
        grad_norms = np.flatnonzero((records["op"] == Op.ALLREDUCE) & (records["count"] == 1))
        for index in grad_norms[:-1]:
            if records[index]["state"] == State.GPU_DONE:
                assert records[index + 1]["t_call_ns"] >= records[index]["gpu_end_ns"] - slack[rank], f"rank {rank}"


def test_a_rank_that_ends_right_after_its_last_synchronisation_keeps_its_last_calls_gpu_times(tmp_path, monkeypatch):
    """On a loaded machine the tracer's poller may not run between a rank's last synchronisation and its
    exit: its last collectives (the final world AllReduce) kept no GPU start or end, and `analyze` read the
    finished healthy run as a hang. A poller that sleeps 100 ms between passes stands for that machine
    (it runs during training, and is behind at the end); the pass at exit writes what the stream reached."""
    monkeypatch.setenv("RANKWATCH_GPU_POLL_US", "100000")
    run(Simulation(world_size=4, tp=1, pp=2, steps=20, compute_us=3000, gpu_timing=True, device="async",
                   ranks_per_node=2), tmp_path)  # fmt: skip
    _, calls = load(tmp_path)
    slack = clock_slack(tmp_path)
    for rank, records in calls.items():
        assert (records["flags"] & Flag.GPU_TIMED).all(), f"rank {rank}: every call was timed"
        unresolved = np.flatnonzero((records["state"] != State.GPU_DONE) | (records["gpu_start_ns"] == 0))
        assert not len(unresolved), f"rank {rank}: calls {unresolved.tolist()} of {len(records)} have no GPU times"
        last = records[-1]
        assert last["op"] == Op.ALLREDUCE and last["count"] == 1, "the last call is the grad norm's AllReduce"
        assert last["gpu_end_ns"] >= last["gpu_start_ns"] >= last["t_call_ns"] - slack[rank]
    # judged as a saved ring is, later: a call still in flight then would be a hang
    report = analyze_trace(load_path(tmp_path), now_ns=time.time_ns() + 60_000_000_000)
    assert report.findings == [], [finding.summary for finding in report.findings]


def test_the_host_spends_cpu_time_each_step_while_its_gpu_waits_for_the_next_launch(tmp_path):
    """The driver's per-step host cost is CPU work (so a starved CPU stretches it), spent after the step's
    last synchronisation: the GPU idles until the host launches the next step."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    host_cost = HostCost(launch_us=0, step_us=30_000)
    run(Simulation(world_size=2, steps=5, compute_us=500, gpu_timing=True, device="async", host_cost=host_cost),
        tmp_path)  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert cpu_s >= 0.9 * 2 * 5 * 0.030, f"2 ranks x 5 steps x 30 ms of CPU, got {cpu_s:.3f} s"
    _, calls = load(tmp_path)
    for rank, records in calls.items():
        grad_norms = np.flatnonzero((records["op"] == Op.ALLREDUCE) & (records["count"] == 1))
        for index in grad_norms[:-1]:
            if records[index]["state"] == State.GPU_DONE:
                idle_ms = (records[index + 1]["t_call_ns"] - records[index]["gpu_end_ns"]) / 1e6
                assert idle_ms >= 29, f"rank {rank}: the next step launched {idle_ms:.1f} ms after the grad norm"


def test_bad_host_cost_is_refused_clearly(tmp_path):
    with pytest.raises(SimulationError, match="--host-us-per-step -1: must be at least 0"):
        run(Simulation(world_size=1, device="async", host_cost=HostCost(step_us=-1)), tmp_path)
    with pytest.raises(SimulationError, match="a --python rank's host cost is its Python"):
        run_pod(PodRun(python=True, host_cost=HostCost(launch_us=20)), {"NPROC_PER_NODE": "1"})


def test_batch_p2p_sync_makes_the_host_wait_after_each_pipeline_exchange(tmp_path):
    run(Simulation(world_size=4, tp=1, pp=4, steps=3, compute_us=2000, gpu_timing=True, device="async",
                   p2p_sync=True), tmp_path)  # fmt: skip
    _, calls = load(tmp_path)
    slack = clock_slack(tmp_path)
    checked = 0
    for rank, records in calls.items():
        p2p = np.flatnonzero(np.isin(records["op"], [Op.SEND, Op.RECV]))
        for index in p2p[p2p < len(records) - 1]:
            if records[index]["state"] == State.GPU_DONE:
                assert records[index + 1]["t_call_ns"] >= records[index]["gpu_end_ns"] - slack[rank], f"rank {rank}"
                checked += 1
    assert checked >= 30


def test_megatron_hang_leaves_peers_calls_returned_and_their_gpus_waiting(tmp_path):
    """A rank that never calls op 20: its peers' call 20 returned on the host (they block later, in a
    synchronisation), and their GPUs never complete it."""
    culprit = 3
    faults = Faults(hang_rank=culprit, hang_at=20)
    outcomes = run(
        Simulation(world_size=4, tp=4, steps=50, compute_us=500, gpu_timing=True, device="async", faults=faults),
        tmp_path,
    )
    assert all(o.exit_code is None for o in outcomes), "everyone is stuck and stopped by the launcher"
    _, calls = load(tmp_path)
    assert len(calls[culprit]) == 19
    for rank in (0, 1, 2):
        twentieth = calls[rank][19]
        assert twentieth["state"] == State.RETURNED and twentieth["t_return_ns"] > 0, "the call returned"
        assert twentieth["gpu_end_ns"] == 0, "... but the collective never completed on the GPU"
        assert (calls[rank][:19]["state"] == State.GPU_DONE).all()


def test_stuck_collective_is_enqueued_on_the_host_and_never_starts_on_its_gpu_while_its_peers_wait(tmp_path):
    """The stuck rank's call returns at once (the operation is enqueued), but its stream never reaches
    it: no GPU start on that rank, while its peers' GPUs started the same collective and wait inside."""
    faults = Faults(stuck_rank=2, stuck_at=10)
    run(Simulation(world_size=4, tp=4, steps=50, compute_us=500, gpu_timing=True, device="async", faults=faults),
        tmp_path)  # fmt: skip
    _, calls = load(tmp_path)
    tenth = calls[2][9]
    assert tenth["state"] == State.RETURNED, "asynchronous: the stuck call itself returned"
    assert tenth["gpu_start_ns"] == 0 and tenth["gpu_end_ns"] == 0, "its GPU work never started"
    assert (calls[2][:9]["state"] == State.GPU_DONE).all(), "the operations before it ran"
    for rank in (0, 1, 3):
        assert calls[rank][9]["gpu_start_ns"] > 0 and calls[rank][9]["gpu_end_ns"] == 0, "its peers started and wait"


def test_collective_that_never_ends_starts_on_every_gpu_and_ends_on_none(tmp_path):
    faults = Faults(never_ends_rank=2, never_ends_at=10)
    run(Simulation(world_size=4, tp=4, steps=50, compute_us=500, gpu_timing=True, device="async", faults=faults),
        tmp_path)  # fmt: skip
    _, calls = load(tmp_path)
    tenth = calls[2][9]
    assert tenth["state"] == State.RETURNED, "asynchronous: the call itself returned"
    assert tenth["gpu_start_ns"] > 0 and tenth["gpu_end_ns"] == 0, "it started on the GPU and never ended"
    for rank in (0, 1, 3):
        assert calls[rank][9]["gpu_start_ns"] > 0 and calls[rank][9]["gpu_end_ns"] == 0, "nor do its peers'"


def test_stopped_device_never_starts_the_collective_its_peers_started(tmp_path):
    """The GPU of rank 1 stops in a kernel: the collective behind it never starts there (no GPU start),
    while its peers' did start and wait; every host call returned."""
    run(Simulation(world_size=4, tp=4, steps=50, compute_us=500, gpu_timing=True, device="async",
                   faults=Faults(device_stop_rank=1, device_stop_at_kernel=12)), tmp_path)  # fmt: skip
    _, calls = load(tmp_path)
    never = calls[1][(calls[1]["gpu_start_ns"] == 0)]
    assert len(never) >= 1 and (never["state"] == State.RETURNED).all(), "called, returned, never started"
    seq = int(never["seq"][0])
    for rank in (0, 2, 3):
        peer = calls[rank][calls[rank]["seq"] == seq]
        same_comm = peer[peer["comm_id"] == never["comm_id"][0]]
        assert same_comm["gpu_start_ns"][0] > 0 and same_comm["gpu_end_ns"][0] == 0, "peers started and wait"


def test_slowed_rank_starts_last_and_waits_least_on_its_gpu(tmp_path):
    """Slower kernels on one rank: on the asynchronous device its host calls return as fast as anyone's;
    the GPU times show it: its collectives start last and wait least."""
    slow = 5
    run(Simulation(world_size=8, tp=4, pp=1, steps=12, compute_us=3000, gpu_timing=True, device="async",
                   faults=Faults(slow_rank=slow, slowdown=0.5)), tmp_path)  # fmt: skip
    _, calls = load(tmp_path)
    tp_peers = [4, 5, 6, 7]
    gpu_wait = {}
    for rank in tp_peers:
        tp = calls[rank][(calls[rank]["op"] == Op.ALLREDUCE) & (calls[rank]["count"] == 4096)]
        tp = tp[tp["state"] == State.GPU_DONE]
        gpu_wait[rank] = float(np.median(tp["gpu_end_ns"] - tp["gpu_start_ns"]))
        assert np.median(tp["t_return_ns"] - tp["t_call_ns"]) < 500_000, "host calls return at once"
    assert min(gpu_wait, key=gpu_wait.get) == slow, gpu_wait
    # its peers wait for its extra compute (1.5 ms a step) on top of what everyone's collective takes,
    # which a loaded machine stretches for all alike: compare differences, not ratios
    extra_ns = 0.5 * 3000 * 1000
    assert min(w for r, w in gpu_wait.items() if r != slow) - gpu_wait[slow] > extra_ns / 2, gpu_wait


def test_slow_link_shows_in_the_gpu_time_of_that_pair(tmp_path):
    run(Simulation(world_size=8, tp=2, pp=4, steps=6, compute_us=500, gpu_timing=True, device="async",
                   faults=Faults(slow_link=(2, 4), link_latency_us=20000)), tmp_path)  # fmt: skip
    _, calls = load(tmp_path)

    def median_recv_gpu_ms(rank, peer_global):
        records = calls[rank]
        recvs = records[(records["op"] == Op.RECV) & (records["peer"] == (peer_global // 2))]
        recvs = recvs[recvs["state"] == State.GPU_DONE]
        return float(np.median(recvs["gpu_end_ns"] - recvs["gpu_start_ns"])) / 1e6

    # a loaded machine stretches every pair's receive alike: compare the pairs, not absolute times
    slow_link_ms, neighbour_ms = median_recv_gpu_ms(4, 2), median_recv_gpu_ms(5, 3)
    assert slow_link_ms - neighbour_ms > 20 / 2, f"only 2 -> 4 is slow: {slow_link_ms} ms, 3 -> 5 {neighbour_ms} ms"


def test_bad_device_model_is_refused_clearly(tmp_path):
    with pytest.raises(SimulationError, match="--device 'gpu': choose one of sync, async"):
        run(Simulation(world_size=2, device="gpu"), tmp_path)


def test_pod_ranks_inherit_the_device_model_while_faults_stay_on_their_rank():
    from rankwatch.standins.simulate import pod_rank_env

    environ = {"NODE_RANK": "1", "NPROC_PER_NODE": "2", "WORLD_SIZE": "4", "RANKWATCH_STANDIN_DEVICE": "async",
               "RANKWATCH_STANDIN_FAULT_RANK": "3", "RANKWATCH_STANDIN_DEVICE_STOP_AT_KERNEL": "9"}  # fmt: skip
    other, faulty = pod_rank_env(environ, 0), pod_rank_env(environ, 1)
    assert other["RANKWATCH_STANDIN_DEVICE"] == faulty["RANKWATCH_STANDIN_DEVICE"] == "async"
    assert "RANKWATCH_STANDIN_DEVICE_STOP_AT_KERNEL" not in other
    assert faulty["RANKWATCH_STANDIN_DEVICE_STOP_AT_KERNEL"] == "9"


def test_a_pods_ranks_follow_torchruns_own_variables_as_the_training_operator_sets_them():
    """A PyTorchJob's pod carries torchrun's PET_NODE_RANK / PET_NPROC_PER_NODE, not NODE_RANK."""
    from rankwatch.standins.simulate import pod_rank_env

    environ = {"PET_NODE_RANK": "2", "PET_NPROC_PER_NODE": "4", "WORLD_SIZE": "12"}
    assert [pod_rank_env(environ, local)["RANK"] for local in range(4)] == ["8", "9", "10", "11"]
    with pytest.raises(SimulationError, match="NODE_RANK"):
        pod_rank_env({"PET_NPROC_PER_NODE": "4", "WORLD_SIZE": "12"}, 0)
