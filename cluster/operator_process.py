"""`rankwatch operator --standalone` for one namespace as a child process of the caller.

The e2e tests and the density bench both run the real operator this way (its log appended to a
file, its collector on a loopback port of the caller's choosing) and stop it themselves.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def start_operator(
    kubeconfig: str | os.PathLike[str],
    namespace: str,
    log: Path,
    collector_port: int,
    settings: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """The operator under ``kubeconfig`` for ``namespace``, its collector on 127.0.0.1:``collector_port``,
    with ``settings`` (RANKWATCH_* variables) on top of this process's environment."""
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "RANKWATCH_COLLECTOR_LISTEN": f"127.0.0.1:{collector_port}",
        **(settings or {}),
    }
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "rankwatch", "operator", "--standalone", "--namespace", namespace],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
