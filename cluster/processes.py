"""Long-running local processes: start detached with a log file, find them again, stop them cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def start(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``argv`` in its own session (so it outlives us and can be stopped as a group)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    return process


def is_running(pid: int | None, executable: str | os.PathLike[str]) -> bool:
    """True if ``pid`` is alive and runs ``executable`` (guards against a recycled pid)."""
    if not pid:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[1].split()[0] == "Z":  # a zombie has exited already
        return False
    if cmdline[0]:
        return cmdline[0] == os.fsencode(executable)
    # Just after an exec the kernel has switched the executable but not yet filled in the command line.
    try:
        return os.path.realpath(f"/proc/{pid}/exe") == os.path.realpath(executable)
    except OSError:
        return False


def stop(pid: int, executable: str | os.PathLike[str], grace_seconds: float = 10.0) -> None:
    """SIGTERM the process group, wait, then SIGKILL whatever is left."""
    if not is_running(pid, executable):
        return
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline:
        if not is_running(pid, executable):
            break
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)  # also kills children the leader left behind
    # Only our own children can be reaped here; for others the init process does it.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def log_tail(log_path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
