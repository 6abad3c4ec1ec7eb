"""Local-cluster timings: cold build of the binaries (optional), fresh `up`, repeated `up`, `down`.

    .venv/bin/python bench/cluster_startup.py [--cold]

--cold builds every binary into an empty binary cache with an empty Go build cache (the module
download cache is kept: on a fresh machine add the download time). Figures go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from figures import Figure, emit

from rankwatch.cluster import binaries
from rankwatch.cluster.local import LocalCluster


def timed(label: str, action) -> float:
    started = time.monotonic()
    action()
    elapsed = time.monotonic() - started
    print(f"{label:<44} {elapsed:8.1f} s", flush=True)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cold", action="store_true", help="also time a cold build (minutes, both cores)")
    parser.add_argument("--nodes", type=int, default=4)
    args = parser.parse_args()
    quiet = lambda _message: None  # noqa: E731

    if args.cold:
        with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as gocache:
            os.environ["RANKWATCH_CACHE_DIR"] = cache
            os.environ["GOCACHE"] = gocache
            timed("cold build of all cluster binaries", lambda: binaries.ensure_all(quiet))
            del os.environ["RANKWATCH_CACHE_DIR"], os.environ["GOCACHE"]
    timed("binaries already cached (lookup)", lambda: binaries.ensure_all(quiet))

    with tempfile.TemporaryDirectory() as root:
        cluster = LocalCluster(Path(root) / "cluster")
        try:
            up_s = timed(f"fresh `cluster up` ({args.nodes} nodes, all Ready)", lambda: cluster.up(args.nodes, quiet))
            emit(Figure(f"cluster.fresh_up.{args.nodes}_nodes", up_s, "s"))
            timed("repeated `cluster up` (already running)", lambda: cluster.up(args.nodes, quiet))
        finally:
            timed("`cluster down` (all processes gone)", lambda: cluster.down(quiet))


if __name__ == "__main__":
    main()
