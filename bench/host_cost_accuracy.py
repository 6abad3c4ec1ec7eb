"""The async accuracy bench's runs with the driver's host cost and without, seed by seed in turn.

    .venv/bin/python bench/host_cost_accuracy.py "straggler 5%" 10 [--launch-us 20 --step-us 500]

Each seed of ``bench/analysis_accuracy.py``'s async scenario (GPU-timed) runs twice, alternately, so
both see the same machine: once with ``--host-us-per-launch``/``--host-us-per-step`` as given, once with
none (the driver's default). Prints right / wrong-node runs / false findings for each, and every miss.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from analysis_accuracy import ASYNC_SCENARIOS, async_case, judge

from rankwatch.analysis.analyze import analyze
from rankwatch.analysis.load import load_path
from rankwatch.standins.simulate import HostCost, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=ASYNC_SCENARIOS)
    parser.add_argument("seeds", type=int)
    parser.add_argument("--launch-us", type=int, default=20)
    parser.add_argument("--step-us", type=int, default=500)
    args = parser.parse_args()
    costs = {"with host cost": HostCost(args.launch_us, args.step_us), "without": HostCost()}
    totals = {name: [0, 0, 0] for name in costs}
    for seed in range(args.seeds):
        for name, cost in costs.items():
            case = async_case(args.scenario, seed, True)
            case.simulation.host_cost = cost
            with tempfile.TemporaryDirectory() as out:
                run(case.simulation, Path(out), log=lambda _m: None)
                trace = load_path(out)
                document = analyze(trace)
                right, _, wrong_node, false, _ = judge(case, document, trace)
            totals[name] = [totals[name][0] + right, totals[name][1] + wrong_node, totals[name][2] + false]
            if not right or wrong_node or false:
                sim = case.simulation
                said = [(f["kind"], f["ranks"]) for f in document["findings"]]
                print(f"  seed {seed} {name}: {sim.world_size} ranks TP{sim.tp} PP{sim.pp}: {said}", flush=True)
    for name, (right, wrong_nodes, false) in totals.items():
        print(f"{args.scenario} {name}: right {right}/{args.seeds}, wrong-node runs {wrong_nodes}, false {false}")


if __name__ == "__main__":
    main()
