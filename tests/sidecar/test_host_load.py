"""Host interference from /proc: a rank process kept off its CPU by a busy neighbour shows it in its
run-queue delay; figures that cannot be read are absent, never zero."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from rankwatch.sidecar.host_load import HostSampler, read_cpu_pressure_us, read_task

# A rank in miniature: short sleeps (its waits) between bursts of work (launching the next step).
RANK_LOOP = (
    "import time\n"
    "while True:\n"
    "    time.sleep(0.002)\n"
    "    start = time.perf_counter()\n"
    "    while time.perf_counter() - start < 0.0005:\n"
    "        pass\n"
)
BUSY_LOOP = "while True:\n    pass\n"


@pytest.fixture
def start() -> Iterator[Callable[..., subprocess.Popen]]:
    started: list[subprocess.Popen] = []

    def run(code: str, setup: Callable[[], None] | None = None) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", code], preexec_fn=setup)
        started.append(process)
        return process

    yield run
    for process in started:
        process.kill()
        process.wait()


def test_a_rank_starved_by_a_busy_neighbour_on_its_cpu_waits_on_the_run_queue(start):
    cpu = max(os.sched_getaffinity(0))

    def starved() -> None:  # the rank shares its CPU with the neighbour and yields to it
        os.sched_setaffinity(0, {cpu})
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

    def neighbour() -> None:  # nice 19: busy, yet polite to everything else on this shared machine
        os.sched_setaffinity(0, {cpu})
        os.nice(19)

    victim = start(RANK_LOOP, starved)
    healthy = start(RANK_LOOP)
    start(BUSY_LOOP, neighbour)
    sampler = HostSampler()
    time.sleep(0.3)
    assert sampler.rank(victim.pid, 1) is None and sampler.rank(healthy.pid, 1) is None, "first reading: no window"
    time.sleep(2.0)
    starved_window, healthy_window = sampler.rank(victim.pid, 1), sampler.rank(healthy.pid, 1)
    assert starved_window is not None and healthy_window is not None
    print(f"starved: {starved_window}; healthy: {healthy_window}")
    # Load only adds waiting: a lower bound holds on a busy machine (a ratio to the healthy rank would
    # not: there the healthy rank waits on the run queue too).
    assert starved_window.run_delay_s > 0.2, "waited a tenth of the window or more for its CPU"
    assert starved_window.cpu_s < starved_window.run_delay_s, "behind its neighbour it waited longer than it ran"
    assert starved_window.cpu_s > 0 and starved_window.involuntary_switches >= 0
    assert sampler.rank(victim.pid, 2) is None, "another process start (a reused pid) begins a new baseline"


def test_counters_of_a_process_and_the_node_are_read_from_proc():
    own = read_task(os.getpid())
    assert own is not None and own.cpu_ns > 0
    assert read_task(2**22 + 1) is None, "no such process"
    if os.path.exists("/proc/pressure/cpu"):
        assert read_cpu_pressure_us() is not None


def test_without_psi_the_node_pressure_is_absent_not_zero(tmp_path):
    sampler = HostSampler(proc=tmp_path)
    assert sampler.cpu_pressure(1_000_000_000) is None and sampler.cpu_pressure(6_000_000_000) is None
    assert sampler.rank(os.getpid(), 1) is None, "a /proc without the process"


def test_node_pressure_is_the_share_of_the_window_some_task_waited(tmp_path):
    pressure = tmp_path / "pressure"
    pressure.mkdir()
    line = "some avg10=1.00 avg60=1.00 avg300=1.00 total={}\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    (pressure / "cpu").write_text(line.format(10_000_000))
    sampler = HostSampler(proc=tmp_path)
    assert sampler.cpu_pressure(1_000_000_000) is None, "first reading"
    (pressure / "cpu").write_text(line.format(12_500_000))  # 2.5 s of stall in a 5 s window
    assert sampler.cpu_pressure(6_000_000_000) == 0.5
    (pressure / "cpu").write_text("garbage\n")
    assert sampler.cpu_pressure(11_000_000_000) is None, "an unreadable file is no figure"
    (pressure / "cpu").write_text(line.format(13_000_000))
    assert sampler.cpu_pressure(16_000_000_000) is None, "a new baseline after a gap"


def test_no_figures_for_processes_of_another_pid_namespace():
    sampler = HostSampler(visible=lambda: False)
    assert sampler.rank(os.getpid(), 1) is None
    assert sampler.rank(os.getpid(), 1) is None
