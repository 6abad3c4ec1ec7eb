"""Run tests/realtorch/megatron_job.py under torchrun in the cached PyTorch environment: shared by the
real-PyTorch tests and bench/real_accuracy.py."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

JOB = Path(__file__).parents[1] / "realtorch" / "megatron_job.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(
    python: Path,
    out: Path,
    *args: str,
    world: int = 8,
    tp: int = 2,
    pp: int = 2,
    buffer_size: int = 2000,
    timeout: float = 240,
    check: bool = True,
) -> Path:
    """torchrun with ``world`` ranks of the job in Megatron's layout; returns ``out`` with the dumps the
    ranks wrote. ``buffer_size``: the flight recorder's ring (TORCH_FR_BUFFER_SIZE): smaller than the
    job's calls, it wraps. ``check``: torchrun must succeed (not when a rank is meant to abort)."""
    out.mkdir(parents=True, exist_ok=True)
    command = [
        str(python), "-m", "torch.distributed.run", "--nproc-per-node", str(world),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(JOB), "--out", str(out), "--tp", str(tp), "--pp", str(pp), *args,
    ]  # fmt: skip
    env = {
        **os.environ,
        "TORCH_FR_BUFFER_SIZE": str(buffer_size),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    result = subprocess.run(command, env=env, cwd=out, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0 and check:
        raise RuntimeError(f"torchrun failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return out


LAYOUT = {"tp": 2, "pp": 2, "world": 8}  # of the real-PyTorch test jobs


SLOW_RANK, STOPPED_RANK, MISMATCH_RANK = 3, 5, 5
