"""Localisation accuracy of `rankwatch analyze` over a fixed suite of simulated runs with ground truth.

    .venv/bin/python bench/analysis_accuracy.py [--repeat 3]

Each scenario is a real `rankwatch simulate` run (stand-in NCCL, tracer preloaded) on this machine;
top-1 means the most likely finding has the right kind and names the culprit rank(s).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rankwatch.analysis.analyze import analyze
from rankwatch.analysis.trace import load_path
from rankwatch.simulate import Faults, Simulation, run

SCENARIOS = [
    ("healthy 16 ranks TP4 PP2", dict(world_size=16, tp=4, pp=2), Faults(), None, None),
    ("straggler 20% (rank 9)", dict(world_size=16, tp=4, pp=2), Faults(slow_rank=9, slowdown=0.2), "straggler", [9]),
    ("straggler 10% (rank 5)", dict(world_size=16, tp=4, pp=2), Faults(slow_rank=5, slowdown=0.1), "straggler", [5]),
    ("straggler 5% (rank 14)", dict(world_size=16, tp=4, pp=2), Faults(slow_rank=14, slowdown=0.05), "straggler", [14]),
    ("hang before call 40 (rank 11)", dict(world_size=16, tp=4, pp=2, steps=60), Faults(hang_rank=11, hang_at=40),
     "hang", [11]),
    ("hang before call 25 (rank 2)", dict(world_size=8, tp=2, pp=2, steps=60), Faults(hang_rank=2, hang_at=25),
     "hang", [2]),
    ("slow link 3<->7", dict(world_size=8, tp=4, pp=2), Faults(slow_link=(3, 7), link_latency_us=3000), "slow_link",
     [3, 7]),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--compute-us", type=int, default=3000)
    args = parser.parse_args()
    print(f"{'scenario':<32} {'top-1':>7} {'false findings':>15} {'seconds':>8}")
    for name, layout, faults, kind, culprits in SCENARIOS:
        hits = false = 0
        started = time.monotonic()
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as out:
                sim = Simulation(**{"steps": args.steps, **layout}, compute_us=args.compute_us, faults=faults)
                run(sim, Path(out), log=lambda _m: None)
                findings = analyze(load_path(out))["findings"]
            if kind is None:
                false += len(findings)
                hits += not findings
                continue
            top = findings[0] if findings else None
            hits += bool(top and top["kind"] == kind and sorted(top["ranks"]) == culprits)
            false += sum(1 for f in findings[1:] if not set(f["ranks"]) <= set(culprits))
        print(f"{name:<32} {hits}/{args.repeat:<5} {false:>15} {time.monotonic() - started:>8.1f}")


if __name__ == "__main__":
    main()
