"""Real torch.distributed jobs (gloo on CPU, under torchrun) with the flight recorder on.

The PyTorch environment is cached outside the repository (tests/support/torch_env.py; ``make test``
builds it first). Each scenario runs once per session; its dumps are shared by the tests.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch_env
import torchrun
from torchrun import LAYOUT, MISMATCH_RANK, SLOW_RANK, STOPPED_RANK


@pytest.fixture(scope="session")
def torch_python() -> Path:
    if os.environ.get("RANKWATCH_SKIP_REAL_TORCH"):
        pytest.skip("RANKWATCH_SKIP_REAL_TORCH is set")
    return torch_env.python()


def run_job(python: Path, out: Path, *args: str, timeout: float = 240, check: bool = True) -> Path:
    """torchrun with LAYOUT's world (``args`` may give another ``--tp`` / ``--pp``); returns ``out`` with
    the dumps the ranks wrote. ``check``: torchrun must succeed (not when a rank is meant to abort)."""
    return torchrun.run_job(
        python, out, *args, world=LAYOUT["world"], tp=LAYOUT["tp"], pp=LAYOUT["pp"], timeout=timeout, check=check
    )


@pytest.fixture(scope="session")
def runs_dir() -> Iterator[Path]:
    """Not pytest's tmp_path: other pytest sessions on the machine prune its old base directories."""
    directory = Path(tempfile.mkdtemp(prefix="rankwatch-realtorch-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def healthy_run(torch_python: Path, runs_dir: Path) -> Path:
    """Pickle dumps; the same run's JSON dumps (taken right after) in ``healthy-json`` beside it."""
    return run_job(torch_python, runs_dir / "healthy", "--steps", "6", "--json-out", str(runs_dir / "healthy-json"))


@pytest.fixture(scope="session")
def healthy_json_run(healthy_run: Path, runs_dir: Path) -> Path:
    """The healthy run's flight recorders dumped as JSON (``_dump_fr_trace_json``), with their journals."""
    return runs_dir / "healthy-json"


@pytest.fixture(scope="session")
def slow_run(torch_python: Path, runs_dir: Path) -> Path:
    slow = ("--slow-rank", str(SLOW_RANK), "--slow-ms", "15")
    return run_job(torch_python, runs_dir / "slow", "--steps", "10", *slow)  # compute a step: from 7 steps


@pytest.fixture(scope="session")
def stopped_all_dump_run(torch_python: Path, runs_dir: Path) -> Path:
    """The stopped rank dumps too, after its peers timed out: what NCCL's dump-on-timeout gives."""
    stop = ("--stop-rank", str(STOPPED_RANK), "--stop-step", "2", "--timeout-s", "8", "--stop-dumps")
    return run_job(torch_python, runs_dir / "stopped-all-dump", "--steps", "4", *stop)


@pytest.fixture(scope="session")
def stopped_run(stopped_all_dump_run: Path, runs_dir: Path) -> Path:
    """The stopped rank writes nothing: the run above without its dump and journal. It wrote them only
    once every peer had timed out and dumped (megatron_job.stop waits for their dumps), so the rest is
    what a run without ``--stop-dumps`` leaves (the peers' files as written, modification times too)."""
    its_own = {f"nccl_trace_rank_{STOPPED_RANK}", f"rank_{STOPPED_RANK}.json"}
    return Path(
        shutil.copytree(stopped_all_dump_run, runs_dir / "stopped", ignore=lambda _, names: its_own & set(names))
    )


@pytest.fixture(scope="session")
def broadcast_mismatch_run(torch_python: Path, runs_dir: Path) -> Path:
    """MISMATCH_RANK calls a broadcast where its TP peer all-reduces."""
    odd = ("--mismatch-rank", str(MISMATCH_RANK), "--mismatch-step", "2", "--mismatch", "op", "--timeout-s", "8")
    return run_job(torch_python, runs_dir / "mismatch-op", "--steps", "4", *odd)


@pytest.fixture(scope="session")
def count_mismatch_run(torch_python: Path, runs_dir: Path) -> Path:
    """TP 4: MISMATCH_RANK all-reduces twice the elements its three TP peers do; gloo aborts the peer that
    receives its larger chunk (no dump), the others time out and dump."""
    odd = ("--mismatch-rank", str(MISMATCH_RANK), "--mismatch-step", "2", "--mismatch", "count", "--timeout-s", "8")
    return run_job(torch_python, runs_dir / "mismatch-count", "--steps", "4", "--tp", "4", *odd, check=False)
