"""PyTorch from PyPI in a cached environment outside the repository, for the real-PyTorch tests.

``~/.cache/rankwatch/torch-<version>/`` (or ``$RANKWATCH_CACHE_DIR/torch-<version>``) holds a venv
with ``torch==<version>`` and nothing of rankwatch: the tests run real torch.distributed jobs there
and analyse their dumps with rankwatch from the project's own venv. Built once per version (a lock
keeps two builders apart); ``make test`` builds it on a fresh machine through ``python
tests/realtorch/torch_env.py``.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

TORCH_VERSION = "2.15.0"  # pins nvidia-nccl-cu13 2.30.7; docs/tests.md names both


def cache_root() -> Path:
    return Path(os.environ.get("RANKWATCH_CACHE_DIR", Path.home() / ".cache" / "rankwatch"))


def environment(version: str = TORCH_VERSION) -> Path:
    return cache_root() / f"torch-{version}"


def python(version: str = TORCH_VERSION) -> Path:
    """The cached environment's interpreter, building the environment first when it is missing."""
    home = environment(version)
    ready = home / ".ready"
    if ready.exists():
        return home / "bin" / "python"
    home.parent.mkdir(parents=True, exist_ok=True)
    with open(home.parent / f".torch-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready.exists():
            _build(home, version)
    return home / "bin" / "python"


def _build(home: Path, version: str) -> None:
    """Into ``home`` directly (venv scripts name their interpreter by path); ``.ready`` marks the end,
    so an interrupted build is started over."""
    started = time.monotonic()
    shutil.rmtree(home, ignore_errors=True)
    print(f"torch_env: installing torch=={version} from PyPI into {home} (about 5 GB)", file=sys.stderr)
    # run outside the repository: its operator/ folder would shadow the standard library's module
    subprocess.run([sys.executable, "-m", "venv", str(home)], check=True, cwd=home.parent)
    pip = [str(home / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "--quiet"]
    subprocess.run([*pip, "install", "--no-cache-dir", f"torch=={version}"], check=True, cwd=home.parent)
    seconds = time.monotonic() - started
    (home / ".ready").write_text(f"torch=={version} installed in {seconds:.0f} s\n")
    print(f"torch_env: ready in {seconds:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    print(python())
