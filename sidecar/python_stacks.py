"""The Python stacks of the pod's rank processes, taken with py-spy when the stall watch fires.

A rank that never makes its next NCCL call is somewhere in Python: a data loader waiting on storage,
a checkpoint write, a deadlock in the training loop. Its ring says only that it stopped; its stack
says where. ``py-spy dump`` (PyPI, a maintained sampling profiler) reads another process's
interpreter state from outside, without pausing it for more than the read and without any change
to the trainer.

Privilege: reading another process's memory is ptrace access. In the same pod that means
``shareProcessNamespace: true`` (the sidecar must see the ranks' pids) and the ``SYS_PTRACE``
capability on the sidecar container (Kubernetes' default capability set does not include it);
where the kernel's Yama ``ptrace_scope`` is 2 or 3 even that is not enough. Without them py-spy
fails and the rank's stack is absent, with the reason logged once; nothing else changes.

Cost: one ``py-spy dump`` per rank process (about 60 ms each), only when a stall report is made (once
per stall episode), run in a worker thread with a time limit per process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

TIMEOUT_S = 5.0
MAX_FRAMES = 12
"""Innermost frames kept per stack: where the rank is, and a few callers to say what it was doing."""


@dataclass(frozen=True)
class StackResult:
    """One process's main-thread stack (innermost first, ``file:line function``), or why there is none."""

    frames: list[str] | None
    problem: str | None = None


def py_spy() -> str | None:
    """The py-spy executable: beside this Python (the sidecar's virtualenv), else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def main_thread_frames(dump: list[dict]) -> list[str] | None:
    """The frames of the process's main thread (the one that runs the training loop) from py-spy's JSON."""
    threads = [thread for thread in dump if isinstance(thread, dict) and thread.get("frames") is not None]
    if not threads:
        return None
    main = next((t for t in threads if t.get("thread_name") == "MainThread" or t.get("os_thread_id") == t.get("pid")),
                threads[0])  # fmt: skip
    return [f"{frame.get('filename')}:{frame.get('line')} {frame.get('name')}" for frame in main["frames"][:MAX_FRAMES]]


PYTHON_NAMES = ("python", "pypy")


def runs_python(pid: int, proc: Path = Path("/proc")) -> bool:
    """False only when ``pid`` is known to run no Python interpreter: its executable and its first
    argument are not named python and no libpython is mapped (a C or C++ trainer). A process whose
    maps cannot be read (no ptrace right) counts as Python: py-spy then says why it cannot read it."""
    names = []
    with contextlib.suppress(OSError):
        names.append(os.path.basename(os.readlink(proc / str(pid) / "exe")))
    with contextlib.suppress(OSError):
        argv0 = (proc / str(pid) / "cmdline").read_bytes().split(b"\0", 1)[0]
        names.append(os.path.basename(argv0.decode(errors="replace")))
    if any(name.startswith(PYTHON_NAMES) for name in names):
        return True
    try:
        with open(proc / str(pid) / "maps", "rb") as maps:
            return any(b"libpython" in line for line in maps)
    except OSError:
        return True


def take_stack(pid: int, executable: str | None = None, timeout_s: float = TIMEOUT_S) -> StackResult:
    """The Python stack of ``pid`` now; a process that is not Python, or not readable, gets a problem."""
    executable = executable or py_spy()
    if executable is None:
        return StackResult(None, "py-spy is not installed")
    try:
        done = subprocess.run(
            [executable, "dump", "--pid", str(pid), "--json", "--nonblocking"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return StackResult(None, f"py-spy took longer than {timeout_s:.0f} s")
    except OSError as error:
        return StackResult(None, f"py-spy could not run: {error}")
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        # py-spy prints "Error: <why>" and then a Rust backtrace: the first line says it
        reason = next((line for line in lines if line.startswith("Error")), lines[0] if lines else None)
        return StackResult(None, reason or f"py-spy exited with {done.returncode}")
    try:
        frames = main_thread_frames(json.loads(done.stdout))
    except json.JSONDecodeError as error:
        return StackResult(None, f"py-spy printed no JSON: {error}")
    return StackResult(frames, None if frames is not None else "no Python thread")


class StackTaker:
    """Takes the stacks of several processes; logs each distinct problem once (a C trainer, or a sidecar
    without SYS_PTRACE, would otherwise say so at every stall)."""

    def __init__(self, executable: str | None = None) -> None:
        self.executable = executable or py_spy()
        self._said: set[str] = set()

    def stacks(self, pids: dict[int, int]) -> dict[int, list[str]]:
        """Rank -> its main thread's frames, for the Python ranks whose stack could be read."""
        found = {}
        for rank, pid in sorted(pids.items()):
            if not runs_python(pid):
                continue
            result = take_stack(pid, self.executable)
            if result.frames is not None:
                found[rank] = result.frames
            elif result.problem not in self._said:
                self._said.add(result.problem or "")
                log.warning(
                    "no Python stack of rank %d (pid %d): %s (a non-Python trainer has none; reading one needs "
                    "shareProcessNamespace and the SYS_PTRACE capability on the sidecar)",
                    rank,
                    pid,
                    result.problem,
                )
        return found
