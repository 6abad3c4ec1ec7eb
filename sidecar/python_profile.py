"""A few seconds of the ranks' Python, sampled with py-spy: where each rank spends its wall time.

A straggler's traces say it is slower, its host figures say whether it was starved; what it is
slower *in* is Python's to say. The operator asks the sidecar of the culprit and of two healthy
peers for a short profile and compares them (differential observability, after PerfTracker): the
functions whose share of the culprit's time differs most from the peers' are where to look.

``py-spy record --format raw --idle --nolineno --nonblocking``: wall-clock samples (``--idle`` keeps
a rank sleeping or blocked in a C call, where a training loop waits), functions aggregated over
their lines, the target never paused. Each function's share is *inclusive*: the fraction of samples
whose stack contains it.

Bounded: at most :data:`MAX_SECONDS` per request at :data:`RATE_HZ`, one request at a time and none
within :data:`MIN_INTERVAL_S` of the previous one (the operator asks once per straggler diagnosis;
anyone else with the job's token cannot turn the sidecar into a profiler that never stops). py-spy
costs about 20 ms of CPU per process-second at 50 Hz, in its own process. The privilege is the one
the stall stacks need (``python_stacks.py``).
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rankwatch.sidecar.python_stacks import py_spy, runs_python

MAX_SECONDS = 10.0
RATE_HZ = 50
MIN_INTERVAL_S = 30.0
MAX_FUNCTIONS = 200
"""Functions kept per rank, most sampled first: a profile's answer stays small."""


@dataclass(frozen=True)
class RankProfile:
    """One rank's samples: how many, and per function (``name (file)``) how many contained it."""

    samples: int = 0
    functions: dict[str, int] = field(default_factory=dict)
    problem: str | None = None
    python: bool = True  # False: the rank runs no Python (a C trainer): nothing to profile, nothing wrong

    def to_json(self) -> dict:
        return {"samples": self.samples, "functions": self.functions, "problem": self.problem, "python": self.python}

    @classmethod
    def from_json(cls, data: dict) -> RankProfile:
        functions = data.get("functions") or {}
        if not isinstance(functions, dict):
            raise ValueError("functions is not an object")
        return cls(int(data.get("samples") or 0), {str(k): int(v) for k, v in functions.items()}, data.get("problem"),
                   data.get("python") is not False)  # fmt: skip


class ProfilerBusy(Exception):
    """A profile runs, or ran too recently; the message says when to ask again."""


def parse_raw(text: str) -> RankProfile:
    """py-spy's raw (collapsed) output: ``outer (file);inner (file) count`` per line."""
    samples = 0
    functions: Counter[str] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples += int(count)
        for frame in set(stack.split(";")):
            functions[frame] += int(count)
    return RankProfile(samples, dict(functions.most_common(MAX_FUNCTIONS)))


def record(pid: int, seconds: float, executable: str, rate_hz: int = RATE_HZ) -> RankProfile:
    """Sample ``pid`` for ``seconds``; a process that cannot be read gets a problem, not an exception."""
    with tempfile.TemporaryDirectory(prefix="rankwatch-profile-") as directory:
        out = Path(directory) / "raw.txt"
        duration = str(max(1, round(seconds)))
        argv = [executable, "record", "--pid", str(pid), "--rate", str(rate_hz), "--duration", duration,
                "--format", "raw", "--idle", "--nolineno", "--nonblocking", "--output", str(out)]  # fmt: skip
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 10)
        except subprocess.TimeoutExpired:
            return RankProfile(problem=f"py-spy record did not end within {seconds + 10:.0f} s")
        except OSError as error:
            return RankProfile(problem=f"py-spy could not run: {error}")
        if done.returncode != 0 or not out.exists():
            lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
            reason = next((line for line in lines if line.startswith("Error")), lines[0] if lines else None)
            return RankProfile(problem=reason or f"py-spy exited with {done.returncode}")
        profile = parse_raw(out.read_text(errors="replace"))
    return profile if profile.samples else RankProfile(problem="no Python samples (not a Python process?)")


class Profiler:
    """Profiles several ranks at once, one request at a time, at most one per :data:`MIN_INTERVAL_S`."""

    def __init__(self, executable: str | None = None, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.executable = executable or py_spy()
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._last: float | None = None

    def profile(self, pids: dict[int, int], seconds: float) -> dict[int, RankProfile]:
        """Rank -> its profile over the same ``seconds`` (all sampled together). Raises ProfilerBusy."""
        if self.executable is None:
            return {rank: RankProfile(problem="py-spy is not installed") for rank in pids}
        seconds = min(max(seconds, 1.0), MAX_SECONDS)
        if not self._lock.acquire(blocking=False):
            raise ProfilerBusy("a profile is under way; ask again when it ends")
        try:
            now = time.monotonic()
            if self._last is not None and now - self._last < self.min_interval_s:
                raise ProfilerBusy(f"profiled {now - self._last:.0f} s ago; ask again in "
                                   f"{self.min_interval_s - (now - self._last):.0f} s")  # fmt: skip
            self._last = now
            executable = self.executable
            python = {rank: pid for rank, pid in pids.items() if runs_python(pid)}
            with ThreadPoolExecutor(max_workers=max(1, len(python))) as pool:
                futures = {rank: pool.submit(record, pid, seconds, executable) for rank, pid in python.items()}
                found = {rank: future.result() for rank, future in futures.items()}
            return {rank: found.get(rank) or RankProfile(python=False) for rank in pids}
        finally:
            self._lock.release()
