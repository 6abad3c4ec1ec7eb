"""A longer fuzzing run of the parsers that read untrusted bytes (the properties of tests/fuzz, with
fresh randomness each run): inputs tried and crashes per target.

    .venv/bin/python bench/fuzz_parsers.py [--examples 20000]

A crash prints hypothesis' smallest failing input; keep it as a regression test in
tests/fuzz/test_fuzz_regressions.py."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "support"))

import fuzz_targets as targets


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=20_000, help="inputs per target")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="rankwatch-fuzz-"))
    (directory / "megatrace").mkdir()
    (directory / "flight-recorder").mkdir()
    (directory / "megascan").mkdir()
    runs = {
        "protocol": (targets.protocol_bodies(), lambda body: targets.decode_protocol(*body)),
        "ring": (targets.ring_files(), lambda data: targets.read_ring_file(data, directory)),
        "megatrace": (targets.megatrace_logs(), lambda logs: targets.read_megatrace(logs, directory / "megatrace")),
        "flight recorder": (
            targets.flight_recorder_dumps(),
            lambda dump: targets.read_flight_recorder(dump, directory / "flight-recorder"),
        ),
        "megascan": (targets.megascan_traces(), lambda trace: targets.read_megascan(trace, directory / "megascan")),
        "alerting config": (targets.config_texts(), targets.load_alerting_config),
    }
    crashes = 0
    print(f"{'target':<16} {'inputs':>8} {'crashes':>8} {'seconds':>8}")
    for name, (strategy, check) in runs.items():
        started = time.perf_counter()
        found = 0
        test = settings(
            max_examples=args.examples, deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )(given(strategy)(check))  # fmt: skip
        try:
            test()
        except Exception:
            found = 1
            traceback.print_exc()
        crashes += found
        print(f"{name:<16} {targets.TRIED[name]:>8} {found:>8} {time.perf_counter() - started:>8.1f}", flush=True)
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
