"""Megatrace log parsing throughput against merely reading the same bytes.

.venv/bin/python bench/megatrace_parse.py [--lines 2000000] [--ranks 8]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rankwatch.analysis.megatrace import read_logs

OPS = ("AllReduce", "AllGather", "ReduceScatter", "Send", "Recv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lines", type=int, default=2_000_000)
    parser.add_argument("--ranks", type=int, default=8)
    args = parser.parse_args()
    per_rank = args.lines // args.ranks
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        for rank in range(args.ranks):
            lines = [
                f"[save_count 1] [1700000000.{i * 1000 % 10**9:09d}] [Rank {rank}] Fun {OPS[i % 5]} "
                f"Data {1024 + i % 7} stream 0x7f3a2c000000 opCount {i} groupHash {-(10**18) + i % 4}\n"
                for i in range(per_rank)
            ]
            (directory / f"rank_{rank}.log").write_text("".join(lines))
        total_bytes = sum(p.stat().st_size for p in directory.glob("*.log"))
        started = time.perf_counter()
        for path in directory.glob("*.log"):
            path.read_bytes()
        read_seconds = time.perf_counter() - started
        started = time.perf_counter()
        trace = read_logs(directory)
        parse_seconds = time.perf_counter() - started
        lines = per_rank * args.ranks
        print(f"{lines} lines, {total_bytes / 2**20:.0f} MiB in {args.ranks} files -> {len(trace.calls)} calls")
        print(f"read bytes only : {read_seconds:6.2f} s  ({lines / read_seconds / 1e6:6.2f} M lines/s)")
        print(f"parse to arrays : {parse_seconds:6.2f} s  ({lines / parse_seconds / 1e6:6.2f} M lines/s)")
        print(f"ratio parse/read: {parse_seconds / read_seconds:6.1f}x")


if __name__ == "__main__":
    main()
