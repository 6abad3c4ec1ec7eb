"""Host interference, read from /proc once per window: how long each rank waited for a CPU, how often it
was preempted, and how much the node as a whole waited for CPUs.

A straggler is not always its GPU's fault: a busy neighbour process (a dataloader with too many
workers, a checkpoint writer, another tenant's container on the same cores) keeps the rank's process
runnable but off the CPU, and it launches its work late. The kernel counts exactly that:

- ``/proc/<pid>/schedstat``: time on a CPU and time runnable but waiting on a run queue (ns). These
  are the main thread's (the one that launches the work; a PyTorch rank has dozens of helper threads
  whose waits would blur it);
- ``/proc/<pid>/status``: ``nonvoluntary_ctxt_switches`` of the same thread (preempted while it still
  wanted to run);
- ``/proc/pressure/cpu``: ``some ... total=`` µs during which at least one runnable task of the node
  (not only of this pod: pressure is not namespaced) waited for a CPU. Kernels built without PSI, or
  booted with ``psi=0``, have no such file: the figure is then absent, not zero.

All counters are cumulative, so a window's figures are differences between two readings: a rank's
first window after the sidecar (or the rank) started has none. Reading them costs two small files
per rank and one per node every window (default 5 s).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rankwatch.protocol import RankScheduling

log = logging.getLogger(__name__)

PROC = Path("/proc")


@dataclass(frozen=True)
class TaskCounters:
    """Cumulative scheduling counters of one process's main thread."""

    cpu_ns: int
    run_delay_ns: int
    involuntary_switches: int


def read_task(pid: int, proc: Path = PROC) -> TaskCounters | None:
    """The counters of ``pid``'s main thread, None when the process is gone or not visible here."""
    try:
        schedstat = (proc / str(pid) / "schedstat").read_bytes().split()
        status = (proc / str(pid) / "status").read_bytes()
    except OSError:
        return None
    marker = status.find(b"nonvoluntary_ctxt_switches:")
    try:
        cpu_ns, run_delay_ns = int(schedstat[0]), int(schedstat[1])
        switches = int(status[marker:].split(None, 2)[1]) if marker >= 0 else 0
    except (IndexError, ValueError):
        return None
    return TaskCounters(cpu_ns, run_delay_ns, switches)


def read_cpu_pressure_us(proc: Path = PROC) -> int | None:
    """The node's cumulative CPU "some" pressure stall time in µs, None without PSI."""
    try:
        text = (proc / "pressure" / "cpu").read_text()
    except OSError:  # no PSI in this kernel (or psi=0): absent, not zero
        return None
    for line in text.splitlines():
        if line.startswith("some "):
            for part in line.split()[1:]:
                key, _, value = part.partition("=")
                if key == "total" and value.isdigit():
                    return int(value)
    return None


class HostSampler:
    """Differences of the counters between consecutive windows, per rank process and for the node.

    ``visible`` says whether the ranks' pids are this process's (a pod sharing its PID namespace; see
    ``ring_tail.ProcessProbe``): otherwise ``/proc/<pid>`` is some other process, and ranks get no figures."""

    def __init__(self, proc: Path = PROC, visible: Callable[[], bool] = lambda: True) -> None:
        self.proc = proc
        self.visible = visible
        self._tasks: dict[int, tuple[int, TaskCounters]] = {}  # pid -> (process start, counters)
        self._pressure: tuple[int, int] | None = None  # (monotonic ns, total µs)
        self._pressure_seen = read_cpu_pressure_us(proc) is not None
        if not self._pressure_seen:
            log.info("no %s (kernel without pressure stall information): no node CPU pressure in summaries",
                     proc / "pressure" / "cpu")  # fmt: skip

    def rank(self, pid: int, start_ns: int) -> RankScheduling | None:
        """The scheduling of ``pid`` since the previous call for the same process (``start_ns`` tells a
        reused pid from the process seen before); None on its first reading or when it is unreadable."""
        counters = read_task(pid, self.proc) if pid > 0 and self.visible() else None
        previous = self._tasks.get(pid)
        if counters is None:
            self._tasks.pop(pid, None)
            return None
        self._tasks[pid] = (start_ns, counters)
        if previous is None or previous[0] != start_ns:
            return None
        before = previous[1]
        return RankScheduling(
            cpu_s=round(max(0, counters.cpu_ns - before.cpu_ns) / 1e9, 6),
            run_delay_s=round(max(0, counters.run_delay_ns - before.run_delay_ns) / 1e9, 6),
            involuntary_switches=max(0, counters.involuntary_switches - before.involuntary_switches),
        )

    def forget_except(self, pids: set[int]) -> None:
        """Drop the readings of processes no longer followed."""
        for pid in [pid for pid in self._tasks if pid not in pids]:
            del self._tasks[pid]

    def cpu_pressure(self, now_monotonic_ns: int) -> float | None:
        """Share of the time since the previous call in which some task of the node waited for a CPU."""
        if not self._pressure_seen:
            return None
        total = read_cpu_pressure_us(self.proc)
        previous, self._pressure = self._pressure, (now_monotonic_ns, total) if total is not None else None
        if total is None or previous is None or now_monotonic_ns <= previous[0]:
            return None
        share = (total - previous[1]) * 1_000 / (now_monotonic_ns - previous[0])
        return round(min(1.0, max(0.0, share)), 4)
