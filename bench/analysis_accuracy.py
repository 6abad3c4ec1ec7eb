"""Localisation accuracy of `rankwatch analyze` over fixed suites of runs with ground truth.

    .venv/bin/python bench/analysis_accuracy.py [--suite simulate|model|all] [--repeat 3] [--seeds 20]

``simulate``: real `rankwatch simulate` runs (stand-in NCCL, tracer preloaded) on this machine.
``model``: the vectorised Megatron model (analysis/scenario.py), 256 ranks TP4 PP4 with clock skew
+-2 ms and jitter, written as wrapped ring files, Megatrace logs or flight-recorder dumps; the culprit
changes with the seed. Top-1 means the most likely finding has the right kind and names exactly the
culprit rank(s); false findings are other findings naming other ranks.
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


def score(findings: list[dict], kind: str | None, culprits: list[int]) -> tuple[bool, int]:
    """(top-1 right, number of false findings)"""
    if kind is None:
        return not findings, len(findings)
    top = findings[0] if findings else None
    hit = bool(top and top["kind"] == kind and sorted(top["ranks"]) == culprits)
    return hit, sum(1 for f in findings[1:] if not set(f["ranks"]) <= set(culprits))


def model_suite(seeds: int) -> None:
    import numpy as np

    from rankwatch.analysis.flight_recorder import write_dumps
    from rankwatch.analysis.megatrace import write_logs
    from rankwatch.analysis.ring_writer import write_rings
    from rankwatch.analysis.scenario import Scenario, generate

    def scenario(kind: str, rng: np.random.Generator, seed: int) -> tuple[Scenario, str | None, list[int]]:
        base = dict(world_size=256, tp=4, pp=4, clock_skew_us=2000, jitter=0.03, seed=seed)
        rank = int(rng.integers(256))
        if kind.startswith("straggler"):
            slowdown = int(kind.split()[1].rstrip("%")) / 100
            return Scenario(**base, stragglers=((rank, slowdown),)), "straggler", [rank]
        if kind == "hang":
            return Scenario(**base, hang_rank=rank, hang_at_call=int(rng.integers(20, 200))), "hang", [rank]
        if kind == "slow link":
            column, stage = int(rng.integers(64)), int(rng.integers(3))
            pair = [column + 64 * stage, column + 64 * (stage + 1)]
            return Scenario(**base, slow_link=tuple(pair), link_latency_us=300), "slow_link", pair
        return Scenario(**base), None, []

    for fmt in ("ring", "megatrace", "flight-recorder"):
        for kind in ("healthy", "straggler 20%", "straggler 10%", "straggler 5%", "hang", "slow link"):
            if fmt == "megatrace" and kind == "slow link":
                continue  # call times only: a link cannot be timed
            hits = false = 0
            started = time.monotonic()
            for seed in range(seeds):
                sc, expected, culprits = scenario(kind, np.random.default_rng(seed), seed)
                synthetic = generate(sc)
                with tempfile.TemporaryDirectory() as out:
                    if fmt == "ring":
                        write_rings(synthetic.trace, out, capacity=1024, parents=synthetic.parents)
                    elif fmt == "megatrace":
                        write_logs(synthetic.trace, out)
                    else:
                        write_dumps(synthetic.trace, out, as_pickle=True, buffer_size=2000)
                    trace = load_path(out)
                    trace.layout, trace.ranks_per_node = synthetic.trace.layout, sc.ranks_per_node
                    hit, wrong = score(analyze(trace)["findings"], expected, culprits)
                hits += hit
                false += wrong
            name = f"{kind} ({fmt})"
            print(f"{name:<32} {hits}/{seeds:<5} {false:>15} {time.monotonic() - started:>8.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["simulate", "model", "all"], default="all")
    parser.add_argument("--repeat", type=int, default=3, help="runs per simulate scenario")
    parser.add_argument("--seeds", type=int, default=20, help="runs per model scenario")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--compute-us", type=int, default=3000)
    args = parser.parse_args()
    print(f"{'scenario':<32} {'top-1':>7} {'false findings':>15} {'seconds':>8}")
    if args.suite in ("model", "all"):
        model_suite(args.seeds)
    if args.suite == "model":
        return
    for name, layout, faults, kind, culprits in SCENARIOS:
        hits = false = 0
        started = time.monotonic()
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as out:
                sim = Simulation(**{"steps": args.steps, **layout}, compute_us=args.compute_us, faults=faults)
                run(sim, Path(out), log=lambda _m: None)
                findings = analyze(load_path(out))["findings"]
            hit, wrong = score(findings, kind, culprits or [])
            hits += hit
            false += wrong
        print(f"{name:<32} {hits}/{args.repeat:<5} {false:>15} {time.monotonic() - started:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
