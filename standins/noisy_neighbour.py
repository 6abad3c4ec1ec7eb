"""A noisy neighbour for the stand-in jobs: busy processes that share one CPU with a rank, as a dataloader
with too many workers or another tenant's process on the same cores does on a real node.

The rank and its neighbours are pinned to the same CPU (the last one this process may use) at the
same priority: the kernel shares that CPU between them, so the rank, runnable after each wait, waits
on the run queue before it can launch its next step. Each neighbour exits by itself once the process
that started it is gone (it checks its parent), so a killed launcher never leaves a busy loop behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

BUSY_LOOP = (
    "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(200_000):\n        pass\n"
)


DEVICE_CPUS = "RANKWATCH_STANDIN_DEVICE_CPUS"
"""Where the stand-in device's executors run (nccl_patch/standin/cuda_standin.c), whatever the rank is pinned to."""


def cpu_list(cpus: set[int]) -> str:
    """``{0, 1, 3}`` as ``0,1,3`` (the form RANKWATCH_STANDIN_DEVICE_CPUS takes)."""
    return ",".join(str(cpu) for cpu in sorted(cpus))


def shared_cpu() -> int:
    """The CPU the rank and its neighbours share: the last one this process may run on."""
    return max(os.sched_getaffinity(0))


def pin_to(cpu: int) -> Callable[[], None]:
    """A ``preexec_fn`` that pins the child to ``cpu``."""

    def pin() -> None:
        os.sched_setaffinity(0, {cpu})

    return pin


def start_neighbours(count: int, cpu: int) -> list[subprocess.Popen]:
    """``count`` busy processes pinned to ``cpu``; the caller stops them (or they stop with it)."""
    return [
        subprocess.Popen([sys.executable, "-c", BUSY_LOOP], preexec_fn=pin_to(cpu), stdin=subprocess.DEVNULL)
        for _ in range(count)
    ]
