"""Where the compiled tracing library, stand-in NCCL/CUDA and drivers are, building them if needed.

From a source checkout they are built by ``make -C nccl_patch`` into ``nccl_patch/build`` (a no-op
when up to date); an installation without sources points ``RANKWATCH_NATIVE_DIR`` at a directory
with the same layout.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parents[1] / "nccl_patch"


class NativeBuildError(RuntimeError):
    """The C parts could not be built or found; the message says how to fix it."""


@dataclass(frozen=True)
class NativeArtifacts:
    root: Path

    @property
    def interposer(self) -> Path:
        return self.root / "librankwatch-nccl.so"

    @property
    def standin_dir(self) -> Path:
        """Holds the stand-in libnccl.so.2 and libcuda.so.1."""
        return self.root / "standin"

    @property
    def megatron_driver(self) -> Path:
        return self.root / "megatron_step"

    @property
    def torch_like(self) -> Path:
        return self.root / "libtorch_like.so"


def native_artifacts() -> NativeArtifacts:
    override = os.environ.get("RANKWATCH_NATIVE_DIR")
    if override:
        artifacts = NativeArtifacts(Path(override))
        if not artifacts.interposer.exists():
            raise NativeBuildError(f"RANKWATCH_NATIVE_DIR={override} has no librankwatch-nccl.so")
        return artifacts
    if not (SOURCE_DIR / "Makefile").exists():
        raise NativeBuildError("no nccl_patch sources next to this installation; set RANKWATCH_NATIVE_DIR")
    result = subprocess.run(["make", "-s", "-C", str(SOURCE_DIR)], capture_output=True, text=True)
    if result.returncode != 0:
        raise NativeBuildError(f"make -C {SOURCE_DIR} failed:\n{result.stdout}{result.stderr}")
    return NativeArtifacts(SOURCE_DIR / "build")
