"""Localisation accuracy of `rankwatch analyze` over fixed suites of runs with ground truth.

    .venv/bin/python bench/analysis_accuracy.py [--suite simulate|model|async|scale|all] [--repeat 3] [--seeds 20]
        [--formats ring megatrace flight-recorder]

``simulate``: real `rankwatch simulate` runs (stand-in NCCL, tracer preloaded) on this machine, on the
synchronous device without GPU timing (host waits are GPU waits), for comparison with the ``async`` suite.
``async``: real runs on the asynchronous stand-in device (NCCL calls return at once, the GPU runs behind
the host), GPU timing on and off, 8 or 16 processes in ten TP x PP layouts (TP and PP 1/2/4/8) taken in
turn by seed, the culprit drawn by seed; see :func:`async_suite` for what counts as right.
``megatrace``: the same real asynchronous runs (healthy, straggler 5/10/20%, a rank that never calls) written
out as Megatrace logs (call times only, ``write_logs``) and read back as `rankwatch analyze` reads Megatrace
logs, clocks taken as aligned and again with ``--ranks-per-node``: stragglers are GPU slowdowns, which host
call times of a run-ahead host cannot localise (nobody else may be named), the hang's culprit must come first.
8 to 32 processes (the async layouts, and TP4 PP2 and TP2 PP4 at 32). ``--logs DIR`` keeps the logs, and
reads them from there when present (the same runs before and after a change).
``megascan``: real asynchronous GPU-timed runs (healthy, straggler 5/10/20%, slow link; the async layouts with
TP and PP > 1) written as MegaScan traces (``megascan.write_traces``) and judged as the async suite judges them.
``scale``: a scale mode, the same model with its hosts running ahead of their GPUs (calls return at once,
the host waits at each step's end), 64 to 1,024 ranks in ten TP x PP layouts (TP and PP 1/2/4/8), GPU
timing on and off, for stragglers, slow links, healthy runs and hangs (a rank that never calls; a call that
never starts on one GPU: the waiting GPUs' hosts go on launching up to the step's end); a model, not real
processes: the async suite stays the judge.
``model``: the vectorised Megatron model (standins/scenario.py), 256 ranks TP4 PP4 with clock skew
+-2 ms and jitter, written as wrapped ring files, Megatrace logs, flight-recorder dumps or MegaScan
traces (``--trace-granularity full``; no hang: MegaScan writes only iterations that ended); the culprit
changes with the seed. Top-1 means the most likely finding has the right kind and names exactly the
culprit rank(s) (for stragglers in Megatrace logs: nobody else is named; call times of slowdowns this
small and short are not localisable); false findings are other findings naming other ranks.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rankwatch.analysis.analyze import analyze
from rankwatch.analysis.load import load_path
from rankwatch.standins.simulate import MISMATCH_KINDS, Faults, Simulation, run

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


MODEL_FORMATS = ("ring", "megatrace", "flight-recorder", "megascan")


def model_suite(seeds: int, formats: tuple[str, ...] = MODEL_FORMATS) -> None:
    import numpy as np

    from rankwatch.analysis.flight_recorder import write_dumps
    from rankwatch.analysis.megascan import write_traces
    from rankwatch.analysis.megatrace import write_logs
    from rankwatch.standins.ring_writer import write_rings
    from rankwatch.standins.scenario import Scenario, generate

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

    for fmt in formats:
        for kind in ("healthy", "straggler 20%", "straggler 10%", "straggler 5%", "hang", "slow link"):
            if fmt == "megatrace" and kind == "slow link":
                continue  # call times only: a link cannot be timed
            if fmt == "megascan" and kind == "hang":
                continue  # MegaScan writes only iterations that ended (rank 0 gathers them): a hang leaves no trace
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
                    elif fmt == "megascan":
                        write_traces(synthetic.trace, out, microbatches=sc.microbatches)
                    else:
                        write_dumps(synthetic.trace, out, as_pickle=True, buffer_size=2000)
                    trace = load_path(out)
                    trace.layout, trace.ranks_per_node = synthetic.trace.layout, sc.ranks_per_node
                    findings = analyze(trace)["findings"]
                    hit, wrong = score(findings, expected, culprits)
                    if fmt == "megatrace" and expected == "straggler":  # call times: not localisable, see
                        hit = all(set(f["ranks"]) <= set(culprits) for f in findings)  # late_windows.py
                hits += hit
                false += wrong
            name = f"{kind} ({fmt})"
            print(f"{name:<32} {hits}/{seeds:<5} {false:>15} {time.monotonic() - started:>8.1f}", flush=True)


# (world size, TP, PP): every TP and PP of 1/2/4/8 that 8 or 16 processes allow on this machine
ASYNC_LAYOUTS = [(8, 1, 8), (8, 8, 1), (8, 2, 4), (8, 4, 2), (16, 1, 4), (16, 2, 8), (16, 4, 4), (16, 8, 2),
                 (16, 4, 2), (16, 1, 2)]  # fmt: skip
ASYNC_SCENARIOS = ["hang", "straggler 5%", "straggler 10%", "straggler 20%", "slow link", "healthy", "device stop",
                   "stuck", "mismatch"]  # fmt: skip
RANKS_PER_NODE = 4


@dataclass
class AsyncCase:
    """One run of the asynchronous suite and the answer expected of it.

    ``mode``: ``exact``, the most likely finding is ``kind`` naming exactly ``culprits``; ``group``, a
    hang whose ranks hold the culprit and lie in one communicator with it smaller than the world (for an
    operation that starts on every member's GPU and never ends: its members look alike); ``unnamed``,
    host call times cannot single the culprit out, so nobody else may be named (naming the culprit is
    fine); ``none``, a healthy run: no finding at all.
    """

    simulation: Simulation
    kind: str | None
    culprits: list[int]
    mode: str


def async_case(scenario: str, seed: int, gpu_timing: bool, steps: int = 20, layouts=ASYNC_LAYOUTS) -> AsyncCase:
    import numpy as np

    rng = np.random.default_rng([seed, ASYNC_SCENARIOS.index(scenario)])  # another culprit per scenario
    layouts = layouts if scenario != "slow link" else [x for x in layouts if x[2] > 1]
    world, tp, pp = layouts[seed % len(layouts)]
    rank = int(rng.integers(world))
    base = dict(world_size=world, tp=tp, pp=pp, ranks_per_node=RANKS_PER_NODE, device="async", gpu_timing=gpu_timing)
    # at least 9 NCCL calls and 6 compute kernels a step: the fault points below fall inside 30 steps
    hang_point, kernel = int(rng.integers(40, 200)), int(rng.integers(30, 150))
    if scenario == "healthy":
        return AsyncCase(Simulation(**base, steps=steps, compute_us=3000), None, [], "none")
    if scenario.startswith("straggler"):
        faults = Faults(slow_rank=rank, slowdown=int(scenario.split()[1].rstrip("%")) / 100)
        simulation = Simulation(**base, steps=steps, compute_us=3000, faults=faults)
        return AsyncCase(simulation, "straggler", [rank], "exact" if gpu_timing else "unnamed")
    if scenario == "hang":
        simulation = Simulation(**base, steps=30, compute_us=1000, faults=Faults(hang_rank=rank, hang_at=hang_point))
        return AsyncCase(simulation, "hang", [rank], "exact")
    if scenario == "stuck":
        simulation = Simulation(**base, steps=30, compute_us=1000, faults=Faults(stuck_rank=rank, stuck_at=hang_point))
        # the stuck operation never starts on the culprit's GPU while its peers' did: GPU times name it
        return AsyncCase(simulation, "hang", [rank], "exact" if gpu_timing else "unnamed")
    if scenario == "device stop":
        faults = Faults(device_stop_rank=rank, device_stop_at_kernel=kernel)
        simulation = Simulation(**base, steps=30, compute_us=1000, faults=faults)
        return AsyncCase(simulation, "hang", [rank], "exact" if gpu_timing else "unnamed")
    if scenario == "mismatch":  # another collective than its peers': what differs turns with the seed
        faults = Faults(mismatch_rank=rank, mismatch_at=hang_point, mismatch=MISMATCH_KINDS[seed % len(MISMATCH_KINDS)])
        simulation = Simulation(**base, steps=30, compute_us=1000, faults=faults)
        return AsyncCase(simulation, "mismatch", [rank], "exact")  # the calls' arguments decide, timed or not
    if scenario == "slow link":
        stride = world // pp  # the next pipeline stage of a rank is this many ranks on
        first = int(rng.integers(world - stride))
        faults = Faults(slow_link=(first, first + stride), link_latency_us=3000)
        simulation = Simulation(**base, steps=steps, compute_us=3000, faults=faults)
        return AsyncCase(simulation, "slow_link", [first, first + stride], "exact" if gpu_timing else "unnamed")
    raise ValueError(f"unknown scenario {scenario!r}")


def allowed_ranks(case: AsyncCase, top: dict | None, trace) -> set[int]:
    """The ranks a finding may name without being wrong."""
    if case.mode != "group" or top is None or case.culprits[0] not in top["ranks"]:
        return set(case.culprits)
    named = set(top["ranks"])
    groups = [set(c.members.values()) for c in trace.comms.values() if c.size < case.simulation.world_size]
    shared = [group for group in groups if named <= group]
    return min(shared, key=len) if shared else set(case.culprits)


def judge(case: AsyncCase, document: dict, trace, node_of=None) -> tuple[bool, bool, bool, int, bool]:
    """(right answer, culprit first, a wrong node named, false findings, "not localisable" said) of one run;
    ``node_of``: how the report names a rank's node (default: the simulation's names)."""
    findings = document["findings"]
    top = findings[0] if findings else None
    allowed = allowed_ranks(case, top, trace)
    right_nodes = {(node_of or case.simulation.node_of)(rank) for rank in allowed}
    wrong_node = any(set(f["nodes"]) - right_nodes for f in findings)
    false = len(findings) if case.mode == "none" else sum(1 for f in findings if not set(f["ranks"]) <= allowed)
    first = bool(top and top["kind"] == case.kind and sorted(top["ranks"]) == sorted(case.culprits))
    if case.mode == "none":
        right = not findings
    elif case.mode == "exact":
        right = first
    elif case.mode == "group":
        right = bool((top and top["kind"] == "hang" and allowed != set(case.culprits)) or first)
    else:
        right = false == 0
    return right, first, wrong_node, false, said_not_localisable(document)


def said_not_localisable(document: dict) -> bool:
    """The report says call times cannot localise the fault: as a problem line, or as a finding
    (a hang) that names nobody for that reason."""
    unnamed = any(not f["ranks"] and "not localisable" in f["summary"] for f in document["findings"])
    return any("not localisable" in problem for problem in document["problems"]) or unnamed


TABLE_COLUMNS = (f"{'evidence':<10} {'right':>6} {'culprit 1st':>11} {'wrong node':>10} "
                 f"{'false findings':>14} {'not localisable':>15} {'seconds':>8}")  # fmt: skip


EVIDENCE = (("GPU-timed", True), ("host only", False))


def scored_table(title: str, scenarios: list[str], seeds: int, score, evidence=EVIDENCE) -> None:
    """One row per scenario and evidence kind: ``score(scenario, seed, kind)`` judges one run as
    (right, culprit first, wrong node, false findings, not localisable) and a line for a miss or None;
    ``evidence``: (row label, kind) pairs, the kind as ``score`` takes it (default: GPU timing on, off)."""
    print(f"{title:<16} {TABLE_COLUMNS}", flush=True)
    for scenario in scenarios:
        for label, gpu_timing in evidence:
            totals = [0, 0, 0, 0, 0]
            started = time.monotonic()
            for seed in range(seeds):
                verdict, miss = score(scenario, seed, gpu_timing)
                totals = [total + int(value) for total, value in zip(totals, verdict, strict=True)]
                if miss:
                    print(f"  seed {seed} {miss}", file=sys.stderr, flush=True)
            right, first, wrong_nodes, false, unlocalisable = totals
            print(f"{scenario:<16} {label:<10} {right:>3}/{seeds:<2} {first:>8}/{seeds:<2} {wrong_nodes:>10} "
                  f"{false:>14} {unlocalisable:>15} {time.monotonic() - started:>8.1f}", flush=True)  # fmt: skip


def async_suite(seeds: int, only: list[str] | None = None, steps: int = 20) -> None:
    def score(scenario: str, seed: int, gpu_timing: bool):
        case = async_case(scenario, seed, gpu_timing, steps)
        with tempfile.TemporaryDirectory() as out:
            run(case.simulation, Path(out), log=lambda _m: None)
            trace = load_path(out)
            document = analyze(trace)
            verdict = judge(case, document, trace)
        miss = None
        if not verdict[0] or verdict[2] or verdict[3]:
            sim = case.simulation
            said = [(f["kind"], f["ranks"], f["nodes"]) for f in document["findings"]]
            miss = f"{sim.world_size} ranks TP{sim.tp} PP{sim.pp} culprits {case.culprits}: {said}"
        return verdict, miss

    scored_table("scenario", only or ASYNC_SCENARIOS, seeds, score)


MEGATRACE_SCENARIOS = ["healthy", "straggler 5%", "straggler 10%", "straggler 20%", "hang"]
MEGATRACE_LAYOUTS = [*ASYNC_LAYOUTS, (32, 4, 2), (32, 2, 4)]  # 12 seeds: each layout once
MEGATRACE_EVIDENCE = (("megatrace", None), ("mt+nodes", RANKS_PER_NODE))  # clocks aligned; offsets per node


def megatrace_suite(seeds: int, only: list[str] | None = None, steps: int = 20, logs: Path | None = None) -> None:
    """Megatrace logs written from real asynchronous runs (see the module); ``logs``: where they are kept."""
    from rankwatch.analysis.megatrace import read_logs, write_logs

    keep = logs or Path(tempfile.mkdtemp(prefix="rankwatch-megatrace-bench-"))

    def score(scenario: str, seed: int, ranks_per_node: int | None):
        case = async_case(scenario, seed, False, steps, MEGATRACE_LAYOUTS)  # Megatrace records no GPU times
        sim = case.simulation
        directory = keep / f"{scenario.replace(' ', '-').rstrip('%')}-seed{seed}-{sim.world_size}x{sim.tp}x{sim.pp}"
        if not any(directory.glob("*.log")):
            with tempfile.TemporaryDirectory() as out:
                run(case.simulation, Path(out), log=lambda _m: None)
                write_logs(load_path(out), directory)
        trace = read_logs(directory)
        trace.ranks_per_node = ranks_per_node
        document = analyze(trace)
        verdict = judge(case, document, trace, node_of=trace.node_of)
        if ranks_per_node is None:  # every node is "unknown" in the report: a wrong rank stands for a wrong node
            named = {rank for f in document["findings"] for rank in f["ranks"]}
            verdict = (*verdict[:2], bool(named - set(allowed_ranks(case, None, trace))), *verdict[3:])
        miss = None
        if not verdict[0] or verdict[2] or verdict[3]:
            sim = case.simulation
            said = [(f["kind"], f["ranks"], f["summary"][:160]) for f in document["findings"]]
            miss = f"{sim.world_size} ranks TP{sim.tp} PP{sim.pp} culprits {case.culprits}: {said}"
        return verdict, miss

    scored_table("megatrace", only or MEGATRACE_SCENARIOS, seeds, score, MEGATRACE_EVIDENCE)


MEGASCAN_SCENARIOS = ["healthy", "straggler 5%", "straggler 10%", "straggler 20%", "slow link"]
# the writer places spans by the TP collectives, and tells a forward's from a backward's by the pipeline
MEGASCAN_LAYOUTS = [layout for layout in ASYNC_LAYOUTS if layout[1] > 1 and layout[2] > 1]


def megascan_suite(seeds: int, only: list[str] | None = None, steps: int = 20) -> None:
    """Real asynchronous GPU-timed runs written as MegaScan traces (``megascan.write_traces``, full
    granularity) and read back as `rankwatch analyze` reads them; judged as the async suite judges."""
    from rankwatch.analysis.megascan import write_traces
    from rankwatch.analysis.topology import Layout

    def score(scenario: str, seed: int, gpu_timing: bool):
        case = async_case(scenario, seed, gpu_timing, steps, MEGASCAN_LAYOUTS)
        sim = case.simulation
        with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as traces:
            run(sim, Path(out), log=lambda _m: None)
            rings = load_path(out, layout=Layout(sim.tp, sim.pp, sim.world_size))
            write_traces(rings, traces, microbatches=sim.microbatches)
            trace = load_path(traces)
            trace.ranks_per_node = RANKS_PER_NODE
            document = analyze(trace)
            verdict = judge(case, document, trace, node_of=trace.node_of)
        miss = None
        if not verdict[0] or verdict[2] or verdict[3]:
            said = [(f["kind"], f["ranks"]) for f in document["findings"]]
            miss = f"{sim.world_size} ranks TP{sim.tp} PP{sim.pp} culprits {case.culprits}: {said}"
        return verdict, miss

    scored_table("megascan", only or MEGASCAN_SCENARIOS, seeds, score, (("GPU-timed", True),))


# scale mode: the vectorised model (standins/scenario.py) with its hosts running ahead of their GPUs,
# 64 to 1,024 ranks; every TP and PP of 1/2/4/8 appears; 8 ranks per node
SCALE_LAYOUTS = [(64, 1, 8), (64, 8, 1), (128, 2, 4), (128, 4, 2), (256, 1, 4), (256, 8, 8), (512, 4, 4),
                 (512, 2, 8), (1024, 8, 2), (1024, 1, 2)]  # fmt: skip
SCALE_SCENARIOS = ["straggler 5%", "straggler 10%", "straggler 20%", "slow link", "healthy", "hang", "stuck"]


def scale_case(scenario: str, seed: int, gpu_timing: bool):
    """(model scenario, expected kind, culprits, whether call times alone must name them) of one
    scale-mode run. A rank that never calls is seen in call times; a call that never starts on one GPU
    (stuck) only in GPU times."""
    import numpy as np

    from rankwatch.standins.scenario import Scenario

    rng = np.random.default_rng([seed, SCALE_SCENARIOS.index(scenario), 13])
    layouts = SCALE_LAYOUTS if scenario != "slow link" else [x for x in SCALE_LAYOUTS if x[2] > 1]
    world, tp, pp = layouts[seed % len(layouts)]
    base = dict(world_size=world, tp=tp, pp=pp, clock_skew_us=2000, jitter=0.03, seed=seed, run_ahead=True,
                gpu_timing=gpu_timing, ranks_per_node=8, compute_us=1000)  # fmt: skip
    rank = int(rng.integers(world))
    calls_per_step = 2 * 2 * (2 * (tp > 1) + (pp > 1)) + (world // (tp * pp) > 1) + 1  # as the model makes them
    fault_call = int(rng.integers(5 * calls_per_step, 15 * calls_per_step))  # between steps 5 and 15 of 20
    if scenario == "hang":
        return Scenario(**base, hang_rank=rank, hang_at_call=fault_call), "hang", [rank], True
    if scenario == "stuck":
        return Scenario(**base, stuck_rank=rank, stuck_at_call=fault_call), "hang", [rank], False
    if scenario.startswith("straggler"):
        slowdown = int(scenario.split()[1].rstrip("%")) / 100
        return Scenario(**base, stragglers=((rank, slowdown),)), "straggler", [rank], False
    if scenario == "slow link":
        stride = world // pp
        first = int(rng.integers(world - stride))
        return (
            Scenario(**base, slow_link=(first, first + stride), link_latency_us=300),
            "slow_link",
            [first, first + stride],
            False,
        )
    return Scenario(**base), None, [], False


def scale_suite(seeds: int, only: list[str] | None = None) -> None:
    """Scale mode (a model, not real processes): GPU-timed runs must name the culprit first; host-only
    runs must name nobody else (call times of a run-ahead host cannot localise a slowdown)."""
    from rankwatch.standins.scenario import generate

    def score(scenario: str, seed: int, gpu_timing: bool):
        model, kind, culprits, in_call_times = scale_case(scenario, seed, gpu_timing)
        synthetic = generate(model)
        document = analyze(synthetic.trace)
        findings = document["findings"]
        top = findings[0] if findings else None
        nodes = {synthetic.trace.node_of(rank) for rank in culprits}
        is_first = bool(top and top["kind"] == kind and sorted(top["ranks"]) == culprits)
        wrong = any(set(f["nodes"]) - nodes for f in findings)
        extra = len(findings) if kind is None else sum(1 for f in findings if not set(f["ranks"]) <= set(culprits))
        ok = not findings if kind is None else (is_first if gpu_timing or in_call_times else extra == 0)
        miss = None
        if not ok or wrong or extra:
            said = [(f["kind"], f["ranks"]) for f in findings]
            miss = f"{model.world_size} ranks TP{model.tp} PP{model.pp} culprits {culprits}: {said}"
        return (ok, is_first, wrong, extra, said_not_localisable(document)), miss

    scored_table("scale (model)", only or SCALE_SCENARIOS, seeds, score)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    suites = ["simulate", "model", "async", "megatrace", "megascan", "scale", "all"]
    parser.add_argument("--suite", choices=suites, default="all")
    parser.add_argument("--repeat", type=int, default=3, help="runs per simulate scenario")
    parser.add_argument("--seeds", type=int, default=20, help="runs per model (or async) scenario")
    parser.add_argument("--only", nargs="*", default=None, help="async scenarios to run (default: all)")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--formats", nargs="*", choices=MODEL_FORMATS, default=MODEL_FORMATS, help="model suite inputs")
    parser.add_argument("--async-steps", type=int, default=20, help="steps of the async healthy, straggler, link runs")
    parser.add_argument("--compute-us", type=int, default=3000)
    parser.add_argument("--logs", type=Path, default=None, help="megatrace suite: keep (and reuse) its logs here")
    args = parser.parse_args()
    if args.suite == "megatrace":
        megatrace_suite(args.seeds, args.only, args.async_steps, args.logs)
        return
    if args.suite == "async":
        async_suite(args.seeds, args.only, args.async_steps)
        return
    if args.suite == "megascan":
        megascan_suite(args.seeds, args.only, args.async_steps)
        return
    if args.suite == "scale":
        scale_suite(args.seeds, args.only)
        return
    print(f"{'scenario':<32} {'top-1':>7} {'false findings':>15} {'seconds':>8}")
    if args.suite in ("model", "all"):
        model_suite(args.seeds, tuple(args.formats))
    if args.suite == "model":
        return
    for name, layout, faults, kind, culprits in SCENARIOS:
        hits = false = 0
        started = time.monotonic()
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as out:
                sim = Simulation(**{"steps": args.steps, **layout}, compute_us=args.compute_us, faults=faults,
                                 device="sync", gpu_timing=False)  # fmt: skip
                run(sim, Path(out), log=lambda _m: None)
                findings = analyze(load_path(out))["findings"]
            hit, wrong = score(findings, kind, culprits or [])
            hits += hit
            false += wrong
        print(f"{name:<32} {hits}/{args.repeat:<5} {false:>15} {time.monotonic() - started:>8.1f}", flush=True)
    if args.suite == "all":
        async_suite(args.seeds, args.only, args.async_steps)


if __name__ == "__main__":
    main()
