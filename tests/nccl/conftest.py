"""Fixtures for the tracing library: the built C parts and a launcher of traced rank processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rankwatch.standins.native import NativeArtifacts, native_artifacts

WORKER = Path(__file__).parent / "scripts" / "rank_worker.py"


@pytest.fixture(scope="session")
def artifacts() -> NativeArtifacts:
    return native_artifacts()


@pytest.fixture
def run_ranks(artifacts: NativeArtifacts, tmp_path: Path) -> Callable[..., list[dict[str, Any]]]:
    """Run ``world`` processes of a rank_worker scenario with the interposer preloaded."""

    def run(scenario: str, world: int, trace_dir: Path | None = None, env: dict[str, str] | None = None,
            preload: bool = True, timeout: float = 60) -> list[dict[str, Any]]:  # fmt: skip
        rendezvous = tmp_path / f"rendezvous-{uuid.uuid4().hex[:6]}"
        rendezvous.mkdir()
        if trace_dir is None and not {"RANKWATCH_TRACE_DIR", "NCCL_MEGATRACE_LOG_PATH"} & set(env or {}):
            trace_dir = tmp_path / f"traces-{rendezvous.name}"  # never the library's shared default in /tmp
            trace_dir.mkdir()
        session = uuid.uuid4().hex[:12]
        processes = []
        for rank in range(world):
            rank_env = {
                **{k: v for k, v in os.environ.items() if not k.startswith(("RANKWATCH_", "NCCL_MEGATRACE"))},
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LD_LIBRARY_PATH": str(artifacts.standin_dir),
                "RANKWATCH_STANDIN_SESSION": session,
                **({"RANKWATCH_TRACE_DIR": str(trace_dir)} if trace_dir else {}),
                **({"LD_PRELOAD": str(artifacts.interposer)} if preload else {}),
                **(env or {}),
            }
            command = [sys.executable, str(WORKER), scenario, str(rendezvous), str(artifacts.torch_like)]
            processes.append(
                subprocess.Popen(command, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )
        results = []
        try:
            for rank, process in enumerate(processes):
                stdout, stderr = process.communicate(timeout=timeout)
                assert process.returncode == 0, f"rank {rank} failed ({process.returncode}):\n{stderr}"
                results.append({"rank": rank, "stderr": stderr, **json.loads(stdout.strip().splitlines()[-1])})
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
            for segment in Path("/dev/shm").glob(f"rwnccl-{session}-*"):
                segment.unlink(missing_ok=True)
        return results

    return run
