"""Megatrace log parsing throughput against merely reading the same bytes.

.venv/bin/python bench/megatrace_parse.py [--lines 2000000] [--ranks 8] [--repeat 3] [--tokenizer C|numpy]

Each repeat reads the files once as bytes (single thread, Path.read_bytes) and once into a Trace
with read_logs (tokenise, drop repeats, sort, build the columnar calls and communicators).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rankwatch.analysis import megatrace

OPS = ("AllReduce", "AllGather", "ReduceScatter", "Send", "Recv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=2_000_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokenizer", choices=("C", "numpy"), help="default: C when built, else numpy")
    args = parser.parse_args()
    if args.tokenizer == "numpy":
        megatrace._native = None
    elif args.tokenizer == "C" and megatrace.tokenizer() != "C":
        parser.error("the C tokeniser (rankwatch.analysis._megatrace_tokenizer) is not built")
    per_rank = args.lines // args.ranks
    lines = per_rank * args.ranks
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        for rank in range(args.ranks):
            text = [
                f"[save_count 1] [1700000000.{i * 1000 % 10**9:09d}] [Rank {rank}] Fun {OPS[i % 5]} "
                f"Data {1024 + i % 7} stream 0x7f3a2c000000 opCount {i} groupHash {-(10**18) + i % 4}\n"
                for i in range(per_rank)
            ]
            (directory / f"rank_{rank}.log").write_text("".join(text))
        total_bytes = sum(p.stat().st_size for p in directory.glob("*.log"))
        print(f"{lines} lines, {total_bytes / 2**20:.0f} MiB in {args.ranks} files, tokeniser: {megatrace.tokenizer()}")
        for run in range(1, args.repeat + 1):
            started = time.perf_counter()
            for path in directory.glob("*.log"):
                path.read_bytes()
            read_seconds = time.perf_counter() - started
            started = time.perf_counter()
            trace = megatrace.read_logs(directory)
            parse_seconds = time.perf_counter() - started
            assert len(trace.calls) == lines and not trace.problems
            print(
                f"run {run}: read bytes only {read_seconds:5.2f} s ({lines / read_seconds / 1e6:5.2f} M lines/s)  "
                f"read_logs {parse_seconds:5.2f} s ({lines / parse_seconds / 1e6:5.2f} M lines/s)  "
                f"ratio {parse_seconds / read_seconds:4.1f}x"
            )


if __name__ == "__main__":
    main()
