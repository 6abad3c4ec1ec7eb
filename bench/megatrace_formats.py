"""Megatrace parsing speed by line format: the bracketed format (rewritten line for line into the
groupHash format before tokenising) against the groupHash format, on the same 1,000,000 calls."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "support"))
from megatrace_lines import bracketed

from rankwatch.analysis.megatrace import read_logs, tokenizer, write_logs


def rate(directory: Path) -> tuple[int, float]:
    started = time.perf_counter()
    trace = read_logs(directory)
    return len(trace.calls), len(trace.calls) / (time.perf_counter() - started)


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        brackets, plain = Path(root, "bracketed"), Path(root, "grouphash")
        brackets.mkdir()
        for rank in range(2):
            (brackets / f"pod{rank}_20260101_000000_{rank}.log").write_bytes(bracketed(rank, range(500_000)))
        write_logs(read_logs(brackets), plain)
        for name, directory in (("bracketed", brackets), ("groupHash", plain)):
            calls, per_second = rate(directory)
            print(f"{name:>10} format ({tokenizer()} tokeniser): {calls:,} calls, {per_second / 1e6:.2f} M lines/s")


if __name__ == "__main__":
    main()
