"""The tracing library on the stand-in NCCL: every call of every rank, recorded once, correctly."""

from __future__ import annotations

import re
import resource
import signal
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from rankwatch.analysis.ring import Flag, Op, RingReader, State, read_ring
from rankwatch.standins.native import native_artifacts

FLOAT32 = 7


def rings_by_rank(trace_dir: Path) -> dict[int, np.ndarray]:
    result = {}
    for path in trace_dir.glob("*.ring"):
        snapshot = read_ring(path)
        result[snapshot.header.global_rank] = snapshot.records
    return result


def collectives(records: np.ndarray) -> np.ndarray:
    return records[records["op"] < Op.COMM_INIT]


def test_every_call_is_recorded_once_with_its_arguments(run_ranks, tmp_path):
    seen = run_ranks("basic", 4, trace_dir=tmp_path)
    assert [r["allreduce"] for r in seen] == [[10.0] * 4] * 4, "the stand-in really reduces across processes"
    assert all(r["broadcast"] == [10.0, 10.0] and r["bcast"] == [200.0] for r in seen)
    assert seen[0]["reduce"] == [4.0] and seen[2]["allgather"] == [0.0, 1.0, 2.0, 3.0]
    assert seen[1]["reducescatter"] == [4.0] and seen[1]["alltoall"] == [1.0, 11.0, 21.0, 31.0]

    rings = rings_by_rank(tmp_path)
    assert sorted(rings) == [0, 1, 2, 3]
    for rank, records in rings.items():
        ops = Counter(Op(op).name for op in records["op"])
        expected = {
            "COMM_INIT": 1, "ALLREDUCE": 4 if rank == 3 else 5, "BROADCAST": 2, "REDUCE": 1, "ALLGATHER": 1,
            "REDUCESCATTER": 1, "ALLTOALL": 1, "GATHER": 1, "SCATTER": 1, "SEND": 1, "RECV": 1, "COMM_SPLIT": 1,
            "COMM_DESTROY": 2 if rank == 3 else 3,
        }  # fmt: skip
        if rank != 3:
            expected["COMM_SHRINK"] = 1
        assert ops == expected, f"rank {rank}"
        assert (records["state"] == State.RETURNED).all() and (records["result"] == 0).all()
        assert (records["t_return_ns"] >= records["t_call_ns"]).all()
        assert (records["global_rank"] == rank).all()

    world = {rank: r[r["op"] == Op.COMM_INIT]["comm_id"][0] for rank, r in rings.items()}
    assert len(set(world.values())) == 1, "the world communicator has one id on every member"
    allreduce = rings[0][rings[0]["op"] == Op.ALLREDUCE][:3]
    assert allreduce["count"].tolist() == [4, 4, 4] and (allreduce["dtype"] == FLOAT32).all()
    assert (allreduce["redop"] == 0).all() and allreduce["seq"].tolist() == [1, 2, 3]
    assert (allreduce["rank"] == 0).all() and (allreduce["nranks"] == 4).all()
    broadcasts = rings[1][rings[1]["op"] == Op.BROADCAST]
    assert broadcasts["peer"].tolist() == [1, 2], "root recorded; ncclBcast -> ncclBroadcast counted once"
    assert rings[0][rings[0]["op"] == Op.GATHER]["peer"].tolist() == [3]


def test_sequence_numbers_agree_across_members_of_each_communicator(run_ranks, tmp_path):
    run_ranks("basic", 4, trace_dir=tmp_path)
    rings = rings_by_rank(tmp_path)
    by_comm: dict[int, dict[int, list[tuple[int, int, int]]]] = {}
    for rank, records in rings.items():
        calls = collectives(records)
        calls = calls[(calls["op"] != Op.SEND) & (calls["op"] != Op.RECV)]
        for comm_id in np.unique(calls["comm_id"]):
            mine = calls[calls["comm_id"] == comm_id]
            by_comm.setdefault(int(comm_id), {})[rank] = list(zip(mine["seq"], mine["op"], mine["count"], strict=True))
    sizes = sorted(len(members) for members in by_comm.values())
    assert sizes == [2, 2, 3, 4], "world, two split halves, the shrunk communicator"
    for comm_id, members in by_comm.items():
        sequences = list(members.values())
        assert all(s == sequences[0] for s in sequences), f"communicator {comm_id:x} disagrees: {members}"
        assert [seq for seq, _, _ in sequences[0]] == list(range(1, len(sequences[0]) + 1))


def test_split_and_shrink_ids_follow_the_parent(run_ranks, tmp_path):
    run_ranks("basic", 4, trace_dir=tmp_path)
    rings = rings_by_rank(tmp_path)
    splits = {rank: r[r["op"] == Op.COMM_SPLIT][0] for rank, r in rings.items()}
    world_id = rings[0][rings[0]["op"] == Op.COMM_INIT]["comm_id"][0]
    assert all(split["aux"] == world_id for split in splits.values()), "the parent is recorded"
    assert splits[0]["comm_id"] == splits[1]["comm_id"] != splits[2]["comm_id"] == splits[3]["comm_id"]
    assert [splits[r]["peer"] for r in range(4)] == [0, 0, 1, 1], "colors recorded"
    shrinks = [r[r["op"] == Op.COMM_SHRINK][0] for rank, r in rings.items() if rank != 3]
    assert len({s["comm_id"] for s in shrinks}) == 1 and all(s["nranks"] == 3 for s in shrinks)


def test_grouped_point_to_point_is_matched_and_completed_at_group_end(run_ranks, tmp_path):
    run_ranks("basic", 4, trace_dir=tmp_path)
    rings = rings_by_rank(tmp_path)
    for rank, records in rings.items():
        send = records[records["op"] == Op.SEND][0]
        recv = records[records["op"] == Op.RECV][0]
        assert send["peer"] == (rank + 1) % 4 and recv["peer"] == (rank - 1) % 4
        assert send["flags"] & Flag.GROUPED and recv["flags"] & Flag.GROUPED
        assert send["group_id"] == recv["group_id"] != 0
        assert send["t_return_ns"] == recv["t_return_ns"], "both return when the group does"
        assert send["seq"] == recv["seq"] == 1, "first send to / receive from that peer"
        partner = rings[(rank + 1) % 4]
        matching = partner[(partner["op"] == Op.RECV) & (partner["peer"] == rank)][0]
        assert (matching["seq"], matching["count"], matching["comm_id"]) == (
            send["seq"],
            send["count"],
            send["comm_id"],
        )


def test_threads_calling_concurrently_lose_nothing(run_ranks, tmp_path):
    run_ranks("threads", 2, trace_dir=tmp_path)
    for rank, records in rings_by_rank(tmp_path).items():
        calls = records[records["op"] == Op.ALLREDUCE]
        assert len(calls) == 4 * 500, f"rank {rank}"
        assert len(set(calls["tid"])) == 4
        for comm_id in np.unique(calls["comm_id"]):
            seqs = np.sort(calls[calls["comm_id"] == comm_id]["seq"])
            assert seqs.tolist() == list(range(1, 501))


def test_ring_wraps_keeping_the_newest_records(run_ranks, tmp_path):
    run_ranks("many", 2, trace_dir=tmp_path, env={"RANKWATCH_RING_RECORDS": "64"})
    for path in tmp_path.glob("*.ring"):
        with RingReader(path) as reader:
            snapshot = reader.read()
            assert snapshot.header.capacity == 64 and snapshot.header.claimed == 1 + 300 + 0
            assert len(snapshot.records) == 64 and snapshot.torn == 0
            assert snapshot.records["seq"].tolist() == list(range(300 - 63, 301))
            later = reader.read(since=snapshot.header.claimed - 10)
            assert len(later.records) == 10 and later.records["seq"][-1] == 300


def test_nccl_loaded_rtld_local_is_traced(run_ranks, tmp_path):
    """rank_worker loads libtorch_like.so (which needs libnccl.so.2) with RTLD_LOCAL, as PyTorch does."""
    run_ranks("few", 2, trace_dir=tmp_path)
    rings = rings_by_rank(tmp_path)
    assert all(len(records[records["op"] == Op.ALLREDUCE]) == 5 for records in rings.values())
    assert all(read_ring(p).header.nccl_version == 22807 for p in tmp_path.glob("*.ring"))


@pytest.mark.parametrize("clock", ["tsc", "gettime"])
def test_timestamps_are_the_realtime_clock(run_ranks, tmp_path, clock):
    """Cheap TSC-derived times (the default) and clock_gettime agree with the system clock."""
    seen = run_ranks("many", 2, trace_dir=tmp_path, env={"RANKWATCH_CLOCK": clock})
    for rank, records in rings_by_rank(tmp_path).items():
        calls = records[records["op"] == Op.ALLREDUCE]
        assert (calls["t_call_ns"] >= seen[rank]["before_ns"] - 200_000).all()
        assert (calls["t_return_ns"] <= seen[rank]["after_ns"] + 200_000).all()
        # rdtsc is not serialising: consecutive stamps may disagree by a few ns, never by a microsecond
        assert (np.diff(calls["t_call_ns"]) > -1000).all(), "a thread's calls are in time order"


def test_disabled_tracing_is_pure_pass_through(run_ranks, tmp_path):
    seen = run_ranks("basic", 4, trace_dir=tmp_path, env={"RANKWATCH_TRACE": "0"})
    assert not list(tmp_path.glob("*.ring"))
    assert seen[0]["allreduce"] == [10.0] * 4
    assert all("rankwatch" not in r["stderr"] for r in seen)


def test_unwritable_directory_warns_once_and_passes_through(run_ranks, tmp_path):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the trace directory should be")
    seen = run_ranks("basic", 4, trace_dir=blocked / "traces")
    assert seen[0]["allreduce"] == [10.0] * 4
    for result in seen:
        warnings = [line for line in result["stderr"].splitlines() if line.startswith("rankwatch:")]
        assert len(warnings) == 1 and "NCCL tracing off" in warnings[0] and "cannot create" in warnings[0]


def test_full_disk_warns_and_passes_through(run_ranks, artifacts, tmp_path):
    """A file-size limit makes the ring's space reservation fail exactly as a full disk does."""
    import subprocess
    import sys

    script = tmp_path / "limited.py"
    script.write_text(
        "import resource, signal, runpy, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    assert signal.SIGXFSZ and resource.RLIMIT_FSIZE  # what the wrapper relies on
    worker = Path(__file__).parent / "scripts" / "rank_worker.py"
    rendezvous = tmp_path / "rv"
    rendezvous.mkdir()
    env = {
        "RANK": "0", "WORLD_SIZE": "1", "LD_LIBRARY_PATH": str(artifacts.standin_dir),
        "LD_PRELOAD": str(artifacts.interposer), "RANKWATCH_TRACE_DIR": str(tmp_path / "traces"),
        "RANKWATCH_STANDIN_SESSION": "fulldisk", "PATH": "/usr/bin:/bin",
    }  # fmt: skip
    result = subprocess.run(
        [sys.executable, str(script), str(worker), "few", str(rendezvous), str(artifacts.torch_like)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "NCCL tracing off" in result.stderr and "cannot reserve" in result.stderr
    assert not list((tmp_path / "traces").glob("*.ring")), "a half-made ring is removed"


def test_megatrace_environment_is_understood(run_ranks, tmp_path):
    run_ranks("few", 2, env={"NCCL_MEGATRACE_LOG_PATH": str(tmp_path), "NCCL_MEGATRACE_SENSTIME": "30000"})
    rings = list(tmp_path.glob("*.ring"))
    assert len(rings) == 2
    assert read_ring(rings[0]).header.sensitivity_ms == 30000
    off = tmp_path / "off"
    run_ranks("few", 2, env={"NCCL_MEGATRACE_LOG_PATH": str(off), "NCCL_MEGATRACE_ENABLE": "0"})
    assert not off.exists() or not list(off.glob("*.ring"))


def test_gpu_timing_fills_gpu_times_and_skips_graph_capture(run_ranks, tmp_path):
    run_ranks("gpu", 2, trace_dir=tmp_path, env={"RANKWATCH_GPU_TIMING": "1"})
    for records in rings_by_rank(tmp_path).values():
        calls = records[records["op"] == Op.ALLREDUCE]
        timed, captured = calls[:20], calls[20:]
        assert len(captured) == 5
        assert (timed["state"] == State.GPU_DONE).all()
        assert (timed["flags"] & Flag.GPU_TIMED).all()
        assert (timed["gpu_start_ns"] > 0).all() and (timed["gpu_end_ns"] >= timed["gpu_start_ns"]).all()
        # the stand-in GPU runs on the host clock: GPU times sit inside the host call
        assert (abs(timed["gpu_start_ns"] - timed["t_call_ns"]) < 50_000_000).all()
        assert (captured["flags"] & Flag.GRAPH_CAPTURE).all()
        assert (captured["gpu_start_ns"] == 0).all() and (captured["state"] == State.RETURNED).all()


def test_bad_gpu_poll_interval_is_named_and_the_default_kept(run_ranks, tmp_path):
    seen = run_ranks("gpu", 2, trace_dir=tmp_path, env={"RANKWATCH_GPU_TIMING": "1", "RANKWATCH_GPU_POLL_US": "1ms"})
    assert all("ignoring RANKWATCH_GPU_POLL_US=1ms (want 1..60000000)" in r["stderr"] for r in seen)
    for records in rings_by_rank(tmp_path).values():
        timed = records[records["op"] == Op.ALLREDUCE][:20]
        assert (timed["state"] == State.GPU_DONE).all(), "timing goes on at the default interval"


def test_single_process_clique_from_comm_init_all(run_ranks, tmp_path):
    [seen] = run_ranks("init_all", 1, trace_dir=tmp_path)
    assert seen["sums"] == [[3.0], [3.0]]
    [records] = rings_by_rank(tmp_path).values()
    inits = records[records["op"] == Op.COMM_INIT]
    assert len(inits) == 2 and inits["comm_id"][0] == inits["comm_id"][1]
    calls = records[records["op"] == Op.ALLREDUCE]
    assert sorted(calls["rank"].tolist()) == [0, 1] and (calls["seq"] == 1).all()
    assert calls["group_id"][0] == calls["group_id"][1] != 0


def test_misuse_returns_nccl_error_codes_and_is_recorded_as_failed(run_ranks, tmp_path):
    seen = run_ranks("misuse", 2, trace_dir=tmp_path)
    invalid_argument, invalid_usage = 4, 5
    for result in seen:
        assert result["root_out_of_range"] == invalid_argument
        assert result["send_to_self"] == invalid_usage
        assert result["bad_datatype"] == invalid_argument
        assert result["group_end_without_start"] == invalid_usage
        assert result["use_after_destroy"] == invalid_argument
    for records in rings_by_rank(tmp_path).values():
        failed = records[records["state"] == State.FAILED]
        assert sorted(failed["result"].tolist()) == [4, 4, 4, 5]
        assert Op.SEND in failed["op"].tolist() and Op.BROADCAST in failed["op"].tolist()


def test_without_the_interposer_nothing_is_written(run_ranks, tmp_path):
    seen = run_ranks("basic", 4, trace_dir=tmp_path, preload=False)
    assert seen[3]["allreduce"] == [10.0] * 4 and not list(tmp_path.glob("*.ring"))


GLIBC_FLOOR = (2, 17)  # the floor docs/tracing-nccl.md states: CentOS 7, Ubuntu 14.04 and every later distribution


def test_the_tracing_library_needs_no_glibc_newer_than_the_stated_floor():
    """It is preloaded into every process of a trainer's image: a symbol version above the floor would
    keep the training processes of an older image from starting at all (gcc on this machine gives 2.34)."""
    library = native_artifacts().interposer
    symbols = subprocess.run(["objdump", "-T", str(library)], capture_output=True, text=True, check=True).stdout
    versions = {tuple(map(int, v.split("."))) for v in re.findall(r"\bGLIBC_(\d+(?:\.\d+)+)\b", symbols)}
    assert versions, f"objdump -T {library} lists no glibc symbol versions"
    assert max(versions) <= GLIBC_FLOOR, f"{library} needs glibc {'.'.join(map(str, max(versions)))}"
    page = (Path(__file__).parents[2] / "docs" / "tracing-nccl.md").read_text()
    assert f"glibc {'.'.join(map(str, GLIBC_FLOOR))}" in page, "docs/tracing-nccl.md states the floor"
