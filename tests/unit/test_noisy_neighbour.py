"""The stand-in's noisy neighbour: busy on the rank's CPU, and never outliving the process that started it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from rankwatch.noisy_neighbour import shared_cpu

LAUNCHER = (
    "import sys, time\n"
    "from rankwatch.noisy_neighbour import shared_cpu, start_neighbours\n"
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
