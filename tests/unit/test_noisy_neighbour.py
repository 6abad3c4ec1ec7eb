"""The stand-in's noisy neighbour: busy on the rank's CPU, and never outliving the process that started it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from rankwatch.standins.noisy_neighbour import shared_cpu

LAUNCHER = (
    "import sys, time\n"
    "from rankwatch.standins.noisy_neighbour import shared_cpu, start_neighbours\n"
    "[neighbour] = start_neighbours(1, shared_cpu())\n"
    "print(neighbour.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_neighbour_is_busy_on_the_shared_cpu_and_exits_when_its_launcher_is_killed():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    pid = int(launcher.stdout.readline())
    try:
        time.sleep(0.5)
        assert os.sched_getaffinity(pid) == {shared_cpu()}
        with open(f"/proc/{pid}/stat") as stat:
            assert stat.read().rsplit(")", 1)[1].split()[0] == "R", "busy: running or runnable"
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 10
    while not gone(pid):
        assert time.monotonic() < deadline, f"neighbour {pid} still running after its launcher was killed"
        time.sleep(0.1)


def gone(pid: int) -> bool:
    """Exited (a zombie its new parent has not reaped yet counts)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_crowded_rank_shares_its_cpu_with_the_neighbours_but_its_stand_in_gpu_does_not(tmp_path):
    """The host thread is pinned with the neighbours; the asynchronous device's executors (the "GPU") keep
    the pod's CPUs, so a starved host launches late and its device runs what it got on time."""
    env = {**os.environ, "NODE_RANK": "0", "NPROC_PER_NODE": "1", "WORLD_SIZE": "1",
           "RANKWATCH_STANDIN_RENDEZVOUS": str(tmp_path), "RANKWATCH_STANDIN_SESSION": "crowded",
           "RANKWATCH_STANDIN_CPU_NEIGHBOURS": "1"}  # fmt: skip
    pod = subprocess.Popen([sys.executable, "-m", "rankwatch", "simulate-pod", "--device", "async",
                            "--steps", "1000000"], env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            rank = next((c for c in children(pod.pid) if "megatron" in comm(c)), None)
            threads = {} if rank is None else {tid: os.sched_getaffinity(tid) for tid in tasks(rank)}
            if len(threads) >= 3:  # the host and at least the compute and NCCL streams' executors
                break
            assert time.monotonic() < deadline, f"no rank with its executors under {pod.pid}: {threads}"
            time.sleep(0.2)
        assert threads.pop(rank) == {shared_cpu()}, "the host shares the neighbours' CPU"
        assert all(cpus == os.sched_getaffinity(0) for cpus in threads.values()), threads
    finally:
        pod.terminate()
        pod.wait(10)


def children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as listed:
            found += [int(child) for child in listed.read().split()]
    return found


def comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as name:
        return name.read().strip()


def tasks(pid: int) -> list[int]:
    return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
