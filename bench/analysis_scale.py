"""Scale: `rankwatch analyze` end to end on ring files of a large synthetic job.

Generates W ranks x ~C calls (Megatron layout, one straggler) as real ring files, then analyses them in
a fresh process (load, hang, slow link, straggler, fail-slow detection, report), printing the time,
the CPU time (user+sys, with its workers) and peak resident memory of that process, and the time and
CPU time merely reading the same bytes takes (the baselines of the figures, measured in the same run).

    python bench/analysis_scale.py                    # 16,384 ranks x ~2,000 calls (about 4 GiB of rings)
    python bench/analysis_scale.py --world-size 2048  # quicker
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from figures import Figure, emit

ANALYSE = """
import json, resource, sys, time
from rankwatch.analysis.analyze import analyze
from rankwatch.analysis.topology import Layout
from rankwatch.analysis.load import load_path
from rankwatch.analysis.heap import keep_freed_memory
keep_freed_memory()  # as `rankwatch analyze` does
started = time.perf_counter()
trace = load_path(sys.argv[1], workers=int(sys.argv[5]))
loaded = time.perf_counter()
trace.layout, trace.ranks_per_node = Layout(*map(int, sys.argv[2:5])), 8
document = analyze(trace)
done = time.perf_counter()
print(json.dumps({"load_s": loaded - started, "detect_s": done - loaded, "calls": len(trace.calls),
                  "findings": [(f["kind"], f["ranks"]) for f in document["findings"]],
                  "problems": document["problems"][:3]}))
"""


def read_bytes(directory: Path) -> tuple[float, float, int]:
    """(seconds, CPU seconds, bytes) reading every file once: the baselines of the analysis' figures."""
    started, cpu, total = time.perf_counter(), time.process_time(), 0
    for path in directory.iterdir():
        total += len(path.read_bytes())
    return time.perf_counter() - started, time.process_time() - cpu, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=16384)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--steps", type=int, default=34)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2, help="processes reading the rings")
    parser.add_argument("--keep", type=Path, help="generate into this directory and keep it (reused when present)")
    args = parser.parse_args()

    from rankwatch.standins.ring_writer import write_rings
    from rankwatch.standins.scenario import Scenario, generate

    directory = args.keep or Path(tempfile.mkdtemp(prefix="rankwatch-scale-"))
    straggler = args.world_size // 3
    if not any(directory.glob("*.ring")):
        started = time.perf_counter()
        scenario = Scenario(args.world_size, tp=args.tp, pp=args.pp, steps=args.steps, microbatches=args.microbatches,
                            stragglers=((straggler, 0.2),), clock_skew_us=2000)  # fmt: skip
        run = generate(scenario)
        generated = time.perf_counter()
        write_rings(run.trace, directory, parents=run.parents)
        print(f"generated {len(run.trace.calls):,} calls in {generated - started:.1f} s, "
              f"wrote rings in {time.perf_counter() - generated:.1f} s")  # fmt: skip
        del run
    try:
        read_s, read_cpu_s, size = read_bytes(directory)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        output = subprocess.run(
            [sys.executable, "-c", ANALYSE, str(directory), *(str(v) for v in (args.tp, args.pp, args.world_size,
                                                                               args.workers))],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        elapsed = time.perf_counter() - started
        peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
        result = json.loads(output)
        cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
        print(f"{args.world_size:,} ranks, {result['calls']:,} calls, {size / 2**30:.2f} GiB of rings "
              f"(expected straggler: rank {straggler})")  # fmt: skip
        print(f"read the bytes only       {read_s:6.2f} s")
        print(f"analyze end to end        {elapsed:6.2f} s  (load {result['load_s']:.2f} s, detect "
              f"{result['detect_s']:.2f} s; {elapsed / read_s:.1f}x reading)")  # fmt: skip
        print(f"peak resident memory      {peak_gib:6.2f} GiB")
        cpu_s = cpu.ru_utime + cpu.ru_stime - before.ru_utime - before.ru_stime
        print(f"cpu time (user+sys)       {cpu_s:6.2f} s  ({read_cpu_s:.2f} s reading the bytes; "
              f"{cpu_s / read_cpu_s:.1f}x)")  # fmt: skip
        print(f"findings: {result['findings'][:3]}  problems: {result['problems']}")
        emit(Figure("analysis.end_to_end", elapsed, "s", read_s, "reading the same bytes"))
        emit(Figure("analysis.peak_resident", peak_gib, "GiB"))
        # CPU time, which the other sessions of a shared machine move far less than the wall clock
        emit(Figure("analysis.cpu_time", cpu_s, "s", read_cpu_s, "CPU time reading the same bytes"))
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
