"""The real NCCL from NVIDIA's wheels (nvidia-nccl-cu12 / -cu13), cached outside the repository.

``~/.cache/rankwatch/nccl/<package>-<version>/`` (or under ``$RANKWATCH_CACHE_DIR``) holds the wheel's
``lib/libnccl.so.2`` and ``include/nccl.h``, fetched once with pip (a lock keeps two fetchers apart).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEELS = (("nvidia-nccl-cu12", "2.21.5"), ("nvidia-nccl-cu13", "2.30.7"))  # Megatrace's NCCL; PyTorch 2.15's


def cache_root() -> Path:
    return Path(os.environ.get("RANKWATCH_CACHE_DIR", Path.home() / ".cache" / "rankwatch")) / "nccl"


def nccl_home(package: str, version: str) -> Path:
    """The directory with lib/libnccl.so.2 and include/nccl.h, fetching the wheel when missing."""
    home = cache_root() / f"{package}-{version}"
    if (home / ".ready").exists():
        return home
    home.parent.mkdir(parents=True, exist_ok=True)
    with open(home.parent / f".{package}-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (home / ".ready").exists():
            _fetch(home, package, version)
    return home


def _fetch(home: Path, package: str, version: str) -> None:
    shutil.rmtree(home, ignore_errors=True)
    with tempfile.TemporaryDirectory() as download:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
             "--no-cache-dir", "--disable-pip-version-check", f"{package}=={version}", "-d", download],
            check=True, cwd=download,
        )  # fmt: skip
        [wheel] = Path(download).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            for name in ("nvidia/nccl/lib/libnccl.so.2", "nvidia/nccl/include/nccl.h"):
                target = home / name.split("nvidia/nccl/", 1)[1]
                target.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(name) as source, open(target, "wb") as out:
                    shutil.copyfileobj(source, out)
    (home / ".ready").write_text(f"{package}=={version}\n")


if __name__ == "__main__":
    for wheel in WHEELS:
        print(nccl_home(*wheel))
