"""The pod's evidence files as one tar, for the operator to archive before the pod is deleted.

Only the files rankwatch and PyTorch write for diagnosis are included: the stall watch's Megatrace
logs (``megatrace/rank_<R>.log``), flight-recorder dumps (``flight_recorder_rank_<R>``, the
prefix the operator injects) and MegaScan traces the job writes to ``megascan/`` (its ``--trace-dir``).
Symbolic links and anything else in the directory are left out; past ``max_bytes`` the remaining
files are left out and listed in ``OMITTED.txt``.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from rankwatch.sidecar.stall_watch import MEGATRACE_SUBDIR

FLIGHT_RECORDER_PREFIX = "flight_recorder_rank_"
MEGASCAN_SUBDIR = "megascan"
MAX_BYTES = 256 << 20


def evidence_files(trace_dir: Path) -> list[Path]:
    """The files to include, relative order stable (sorted)."""
    candidates = [
        *sorted(trace_dir.glob(f"{FLIGHT_RECORDER_PREFIX}*")),
        *sorted((trace_dir / MEGATRACE_SUBDIR).glob("*.log")),
        *sorted((trace_dir / MEGASCAN_SUBDIR).glob("benchmark-data-*.json")),
    ]
    return [path for path in candidates if path.is_file() and not path.is_symlink()]


def evidence_tar(trace_dir: Path, max_bytes: int = MAX_BYTES) -> bytes:
    """The tar (uncompressed: the logs are read once, by the operator next door)."""
    buffer = io.BytesIO()
    omitted: list[str] = []
    total = 0
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for path in evidence_files(trace_dir):
            name = str(path.relative_to(trace_dir))
            try:
                size = path.stat().st_size
                if total + size > max_bytes:
                    omitted.append(f"{name}: over the {max_bytes >> 20} MiB limit of one pod's evidence")
                    continue
                archive.add(path, arcname=name, recursive=False)
                total += size
            except OSError as error:  # a file replaced or removed while being read
                omitted.append(f"{name}: {error.strerror or error}")
        if omitted:
            text = ("\n".join(omitted) + "\n").encode()
            info = tarfile.TarInfo("OMITTED.txt")
            info.size = len(text)
            archive.addfile(info, io.BytesIO(text))
    return buffer.getvalue()
