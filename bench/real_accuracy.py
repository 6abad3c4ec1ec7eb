"""Localisation accuracy of `rankwatch analyze` on real torch.distributed jobs (gloo on CPU, torchrun).

    .venv/bin/python bench/real_accuracy.py [--seeds 5] [--cells healthy slow-20 ...] [--torch 2.15.0]
        [--results runs.jsonl] [--keep DIR]
    .venv/bin/python bench/real_accuracy.py --reanalyse DIR   # the runs kept in DIR, judged again

Each run is tests/realtorch/megatron_job.py in PyTorch from PyPI (the cached environment of
tests/realtorch/torch_env.py), drawn per seed: world 8 or 16, a Megatron layout of it (TP and PP 1, 2,
4), 1-10 ms of compute per microbatch spent as a sleep, a CPU-bound loop or tensor products, the
flight recorder's dumps as pickle or JSON, a ring small enough to wrap in some runs. The cell says
the fault: ``healthy``, ``noisy`` (healthy, with a process burning a CPU beside the job), ``slow-P``
(one random rank computes P% longer all run), ``onset-P`` (P% longer from a random step on),
``mismatch-K`` (at a random step one random rank calls, at its first TP collective, a broadcast where its
TP peers all-reduce (K ``op``), twice their elements (``count``) or float64 (``dtype``); layouts with TP > 1),
``stop-D`` (at a random step one random rank stops outside any collective; its peers time out and dump;
D ``dump``: it dumps too, as NCCL's dump-on-timeout makes every rank dump; ``nodump``: it writes none;
``partial``: it writes none and each other rank's dump is lost with probability 1/4, as when some pods
die before their dump is collected), ``stuck`` (at a random step one random rank gets stuck *inside* its
first TP collective, DP with TP 1: its gloo workers there freeze; every rank dumps), ``slowlink`` (every
transfer between one random rank and its next pipeline stage's peer arrives late by one microbatch's
compute; layouts with PP > 1; either rank of the link counts as the culprit).

Scored per run from the JSON document: *culprit first* (the first finding names the faulty rank alone,
or for ``slowlink`` ranks of the link; for mismatches, as a ``mismatch`` of cause ``software``, which is
never cordoned), *other named* (any finding names another rank: a healthy node cordoned), *not localisable*
(no finding names a rank and the problems say why), *false* (healthy cells: any finding). A run whose
job fails (torchrun's exit) is counted as such, not scored. ``--results`` appends every run as a JSON
line; the table is printed at the end with the machine's load average.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
import torch_env
import torchrun

from rankwatch.analysis.analyze import analyze
from rankwatch.analysis.load import load_path
from rankwatch.analysis.topology import Layout

SLOWDOWNS = (10, 20, 30, 50, 100, 200)
MISMATCHES = ("op", "count", "dtype")
STOPS = ("dump", "nodump", "partial")
CELLS = (
    "healthy", "noisy", *(f"slow-{p}" for p in SLOWDOWNS), "onset-50",
    *(f"mismatch-{k}" for k in MISMATCHES), *(f"stop-{d}" for d in STOPS), "stuck", "slowlink",
)  # fmt: skip
TIMEOUT_S = 8  # the process groups' timeout: how long a hung group waits before it dumps
# ... and in runs that do not hang, a job's usual one (PyTorch's default is 10 minutes or more): every rank
# dumps as the job ends, and pickle dumps with stack traces took 12-24 s to write at load 20, longer than the
# job's own 20 s, with some rank's last collective not yet retired: no timeout could have fired there
RUNNING_TIMEOUT_S = 600
LOST_DUMP = 0.25  # stop-partial: the chance that a surviving rank's dump is lost
LAYOUTS = {8: [(2, 2), (1, 2), (2, 1), (4, 2), (1, 1), (1, 4)], 16: [(2, 2), (4, 2), (1, 4), (2, 4), (4, 1)]}
KINDS = ("sleep", "sleep", "spin", "tensor")  # sleep twice as often: 16 CPU-bound ranks on 2 shared cores crawl
TRAIN_MS = 2500  # about this much training per run


@dataclass
class Run:
    cell: str
    seed: int
    world: int
    tp: int
    pp: int
    compute_ms: float
    kind: str
    dump: str
    buffer: int
    steps: int
    culprit: int = -1
    slow_pct: float = 0.0
    onset_step: int = 0
    mismatch: str = ""
    mismatch_step: int = -1
    stop: str = ""
    stop_step: int = -1
    stuck_step: int = -1
    link: tuple[int, ...] = ()  # slowlink: the two ranks of the slow link
    link_ms: float = 0.0


def draw(cell: str, seed: int) -> Run:
    """The run of ``cell`` for ``seed``: the same on every machine."""
    rng = random.Random(f"{cell}/{seed}")
    world = rng.choice((8, 8, 16))
    layouts = LAYOUTS[world]
    if cell.startswith("mismatch-"):  # the odd call is a TP collective: a TP group of one has nobody to disagree
        layouts = [(tp, pp) for tp, pp in layouts if tp > 1]
    if cell == "slowlink":  # a pipeline link: PP > 1
        layouts = [(tp, pp) for tp, pp in layouts if pp > 1]
    tp, pp = rng.choice(layouts)
    compute_ms = round(rng.uniform(1, 10), 1)
    kind = rng.choice(KINDS)
    microbatches = 4
    step_ms = 2 * microbatches * compute_ms * (1 + (pp - 1) / microbatches) + 3
    steps = max(10, min(40, round(TRAIN_MS / step_ms)))
    calls_per_step = 2 * microbatches + 2
    buffer = rng.choice((2000, 2000, max(60, calls_per_step * steps // 2)))  # a third wrap
    run = Run(cell, seed, world, tp, pp, compute_ms, kind, rng.choice(("pickle", "json")), buffer, steps)
    if cell.startswith(("slow-", "onset-")):
        run.culprit = rng.randrange(world)
        run.slow_pct = float(cell.split("-")[1])
        run.onset_step = rng.randrange(steps // 4, steps // 2) if cell.startswith("onset-") else 0
    if cell.startswith("mismatch-"):
        run.culprit, run.mismatch = rng.randrange(world), cell.split("-")[1]
        run.mismatch_step = rng.randrange(1, steps)
    if cell.startswith("stop-"):
        run.culprit, run.stop = rng.randrange(world), cell.split("-")[1]
        run.stop_step = rng.randrange(1, steps)
    if cell == "stuck":
        run.culprit, run.stuck_step = rng.randrange(world), rng.randrange(1, steps)
    if cell == "slowlink":  # a rank of stages 0..PP-2 and its peer in the next stage
        run.culprit = rng.randrange(world - world // pp)
        run.link, run.link_ms = (run.culprit, run.culprit + world // pp), compute_ms
    return run


def execute(run: Run, python: Path, out: Path) -> Path:
    args = ["--steps", str(run.steps), "--compute-ms", str(run.compute_ms), "--compute-kind", run.kind]
    if run.mismatch:
        args += ["--mismatch-rank", str(run.culprit), "--mismatch-step", str(run.mismatch_step)]
        args += ["--mismatch", run.mismatch, "--timeout-s", str(TIMEOUT_S)]
    elif run.stop:
        args += ["--stop-rank", str(run.culprit), "--stop-step", str(run.stop_step), "--timeout-s", str(TIMEOUT_S)]
        args += ["--stop-dumps"] if run.stop == "dump" else []
    elif run.stuck_step >= 0:
        args += ["--stuck-rank", str(run.culprit), "--stuck-step", str(run.stuck_step), "--timeout-s", str(TIMEOUT_S)]
    elif run.link:
        args += ["--slow-link", *map(str, run.link), "--link-ms", str(run.link_ms)]
    elif run.culprit >= 0:
        args += ["--slow-rank", str(run.culprit), "--slow-pct", str(run.slow_pct)]
        args += ["--slow-from-step", str(run.onset_step)]
    if not (run.mismatch or run.stop or run.stuck_step >= 0):
        args += ["--timeout-s", str(RUNNING_TIMEOUT_S)]
    if run.dump == "json":
        args.append("--json")
    neighbour = None
    if run.cell == "noisy":  # a CPU-bound process beside the job, as a co-tenant's would be
        neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        # gloo aborts the odd rank's neighbour that receives more bytes than it expects (count, dtype)
        check = run.mismatch in ("", "op")
        return torchrun.run_job(
            python, out, *args, world=run.world, tp=run.tp, pp=run.pp, buffer_size=run.buffer, timeout=600, check=check
        )
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()


def score(run: Run, document: dict) -> dict:
    findings = document["findings"]
    named = [set(f["ranks"]) for f in findings]
    if run.culprit < 0:
        return {"false": bool(findings)}
    culprits = set(run.link) or {run.culprit}  # a slow link: either of its ranks, or both
    first = bool(named) and bool(named[0]) and named[0] <= culprits
    if run.mismatch:
        first = first and (findings[0]["kind"], findings[0]["cause"]) == ("mismatch", "software")
    other = any(ranks - culprits for ranks in named)
    # a hang found but pinned on nobody says why in its summary; a straggler too weak to name, in problems
    said = [*document["problems"], *(f["summary"] for f in findings)]
    unlocalised = not any(named) and any("not localisable" in text for text in said)
    return {"first": first, "other": other, "not_localisable": unlocalised}


def measure(run: Run, python: Path, keep: Path | None) -> dict:
    base = keep or Path(tempfile.mkdtemp(prefix="rankwatch-real-bench-"))
    out = base / f"{run.cell}-{run.seed}"
    started = time.monotonic()
    record = {**asdict(run), "load": os.getloadavg()[0]}
    try:
        execute(run, python, out)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        return {**record, "failed": str(error)[-300:]}
    finally:
        record["job_s"] = round(time.monotonic() - started, 1)
    if run.stop == "partial":
        record["lost_dumps"] = lose_dumps(run, out)
    record.update(judged(run, out))
    if keep is None:
        subprocess.run(["rm", "-rf", str(out)], check=False)
    return record


def lose_dumps(run: Run, out: Path) -> list[int]:
    """Delete each surviving rank's dump with probability ``LOST_DUMP`` (the same ranks for a seed),
    keeping at least one; the ranks whose dumps are gone."""
    rng = random.Random(f"{run.cell}/{run.seed}/lost")
    dumps = sorted(out.glob("nccl_trace_rank_*"), key=lambda path: int(path.name.rsplit("_", 1)[1]))
    lost = [path for path in dumps if rng.random() < LOST_DUMP][: len(dumps) - 1]
    for path in lost:
        path.unlink()
    return [int(path.name.rsplit("_", 1)[1]) for path in lost]


def judged(run: Run, out: Path) -> dict:
    """The analysis of a run's dumps, and its score."""
    trace = load_path(out, layout=Layout(run.tp, run.pp, run.world))
    document = analyze(trace)
    findings = [{"kind": f["kind"], "ranks": f["ranks"], "summary": f["summary"]} for f in document["findings"]]
    return {"findings": findings, "problems": document["problems"], **score(run, document)}


def reanalysed(kept: Path) -> list[dict]:
    """The runs kept under ``kept`` (``--keep`` of an earlier bench: ``<cell>-<seed>`` folders) judged
    again by this checkout's analysis: decisions compared on the same dumps."""
    records = []
    for out in sorted(kept.iterdir()):
        cell, _, seed = out.name.rpartition("-")
        if cell not in CELLS or not seed.isdigit() or not any(out.glob("nccl_trace_rank_*")):
            continue
        run = draw(cell, int(seed))
        records.append({**asdict(run), "load": float("nan"), **judged(run, out)})
    return records


def table(records: list[dict]) -> str:
    """One row per PyTorch version and cell, then per way of computing: a sleep, or CPU-bound work (a
    loop, tensor products) that 8-16 ranks on a few shared cores stretch unevenly."""
    lines = [
        "| torch | cell | compute | runs | culprit first | other rank named | not localisable | false findings"
        " | job failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    versions = sorted({r.get("torch", "?") for r in records})
    for version in versions:
        for cell in CELLS:
            for compute in ("all", "sleep", "CPU-bound"):
                mine = [
                    r
                    for r in records
                    if r["cell"] == cell and r.get("torch", "?") == version and compute in ("all", _compute_of(r))
                ]
                if mine:
                    lines.append(f"| {version} " + _row(cell, compute, mine))
    loads = [r["load"] for r in records if r["load"] == r["load"]]  # NaN: reanalysed, no load of its own
    if loads:
        lines.append(f"\nload average (1 min) during the runs: {min(loads):.1f} to {max(loads):.1f}")
    return "\n".join(lines)


def _compute_of(record: dict) -> str:
    return "sleep" if record["kind"] == "sleep" else "CPU-bound"


def _row(cell: str, compute: str, mine: list[dict]) -> str:
    done = [r for r in mine if "failed" not in r]
    failed = len(mine) - len(done)
    if cell in ("healthy", "noisy"):
        return f"| {cell} | {compute} | {len(done)} | - | - | - | {sum(r['false'] for r in done)} | {failed} |"
    first = sum(r["first"] for r in done)
    other = sum(r["other"] for r in done)
    unloc = sum(r["not_localisable"] for r in done)
    return f"| {cell} | {compute} | {len(done)} | {first} | {other} | {unloc} | - | {failed} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--cells", nargs="+", default=list(CELLS), choices=CELLS)
    parser.add_argument(
        "--torch", nargs="+", default=[torch_env.TORCH_VERSION], help="PyTorch versions (cached environments)"
    )
    parser.add_argument("--results", type=Path, help="append each run as a JSON line; the table counts them all")
    parser.add_argument("--keep", type=Path, help="keep the runs' dumps under this directory")
    parser.add_argument("--table-only", action="store_true", help="print the table of --results and exit")
    parser.add_argument("--reanalyse", type=Path, help="judge the runs an earlier --keep kept again, and exit")
    args = parser.parse_args()
    if args.reanalyse:
        print(table(reanalysed(args.reanalyse)))
        return 0
    records = []
    if args.results and args.results.exists():
        records = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    if not args.table_only:
        pythons = {version: torch_env.python(version) for version in args.torch}
        for seed, cell, version in itertools.product(
            range(args.first_seed, args.first_seed + args.seeds), args.cells, args.torch
        ):
            keep = args.keep / version if args.keep and len(args.torch) > 1 else args.keep
            record = {**measure(draw(cell, seed), pythons[version], keep), "torch": version}
            records.append(record)
            verdict = {k: record[k] for k in ("first", "other", "not_localisable", "false", "failed") if k in record}
            named = [f["ranks"] for f in record.get("findings", [])]
            shape = f"{record['world']} ranks TP{record['tp']} PP{record['pp']} {record['compute_ms']} ms"
            print(f"torch {version} {cell} seed {seed} ({shape} {record['kind']}): {verdict} {named}", flush=True)
            if args.results:
                with args.results.open("a") as handle:
                    handle.write(json.dumps(record) + "\n")
    print(table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
