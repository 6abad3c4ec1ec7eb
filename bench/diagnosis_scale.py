"""One diagnosis of a 16,384-rank job within the operator's default limits.

The operator's side of a diagnosis, at scale: the job's state as the collector folds it (12 windows
of summaries from 2,048 pods, bench/operator_cpu.py builds them), the pods a diagnosis asks
(``pods_to_ask``) and the records per ring (``records_limit``) for the suspicion, the dumps those
sidecars would answer (rings of a generated 16,384-rank TP 8 x PP 4 run with one 20% straggler,
rankwatch.standins.scenario, cut as the sidecar's /dump cuts them), and the analysis in the
operator's worker process under the default budget (``DiagnosisLimits``: 512 MiB for 2 concurrent
diagnoses, 256 MiB each, 300 s), which kills it beyond either.

Per suspicion (the detector's straggler, with its rank; a job-wide slowdown, no rank): pods asked,
records per ring, dump MiB, the worker's time, peak address space (its limit) and peak RSS, and the
finding. Not here: fetching the dumps over HTTP (bounded per pod, streamed to files; the e2e tests
run it), and the detector (bench/operator_scale.py).

    nice -n 10 .venv/bin/python bench/diagnosis_scale.py [--world-size 16384] [--steps 8] [--microbatches 4]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gzip
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from operator_cpu import RANKS_PER_POD, summaries

from rankwatch import protocol
from rankwatch.analysis.topology import Layout
from rankwatch.model.finding import FindingKind
from rankwatch.operator.config import DiagnosisLimits
from rankwatch.operator.diagnosis.detect.detector import suspected
from rankwatch.operator.diagnosis.diagnose.diagnose import DiagnosisBudget, pods_to_ask, records_limit
from rankwatch.operator.diagnosis.diagnose.worker import AnalysisRequest, WorkerFailed, analyse
from rankwatch.operator.diagnosis.ingest.job_state import JobStore, StateLimits
from rankwatch.operator.sidecar_client import SidecarPod
from rankwatch.sidecar.dump import ring_image, select
from rankwatch.sidecar.ring_tail import RingTail
from rankwatch.standins.ring_writer import write_rings
from rankwatch.standins.scenario import Scenario, generate

TP, PP = 8, 4
MIB = 1 << 20


def job_state(world: int) -> tuple[object, float]:
    """The job's state after 12 windows, folded as the collector folds them; seconds to fold."""
    state = JobStore().get("bench", "big", StateLimits.for_job(world, world // RANKS_PER_POD))
    generator = random.Random(0)
    bodies = [[gzip.decompress(body) for _, body in summaries(world, window, generator, PP)] for window in range(1, 13)]
    started = time.perf_counter()
    for number, window in enumerate(bodies):
        for body in window:
            state.add_summary(protocol.parse_summary(body), now=1000.0 + 5 * number)
    return state, time.perf_counter() - started


def write_dumps(ring_of_rank: dict[int, Path], pods: list[str], limit: int, directory: Path) -> int:
    """One ``<pod>.dump`` per pod as its sidecar's /dump answers it: each ring's last ``limit`` records."""
    directory.mkdir(parents=True)
    size = 0
    for pod in pods:
        first = int(pod.rsplit("-", 1)[1]) * RANKS_PER_POD
        path = directory / f"{pod}.dump"
        with path.open("wb") as out:
            for rank in range(first, first + RANKS_PER_POD):
                tail = RingTail(ring_of_rank[rank])
                chosen, _ = select(tail, 0, limit)
                out.write(ring_image(tail, np.ascontiguousarray(chosen)))
        size += path.stat().st_size
    return size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    world = args.world_size
    layout = Layout(TP, PP, world)
    limits = DiagnosisLimits()
    budget = DiagnosisBudget(limits.worker_memory_bytes, limits.timeout_seconds)
    straggler = world // 3

    state, fold_s = job_state(world)
    print(f"{world:,} ranks: job state of 12 windows folded in {fold_s:.1f} s", flush=True)
    work = Path(tempfile.mkdtemp(prefix="rankwatch-diagnosis-scale-"))
    try:
        started = time.perf_counter()
        scenario = Scenario(world, tp=TP, pp=PP, steps=args.steps, microbatches=args.microbatches,
                            stragglers=((straggler, 0.2),), clock_skew_us=2000)  # fmt: skip
        run = generate(scenario)
        generated = time.perf_counter() - started
        pods = [SidecarPod(f"big-worker-{i}", f"gpu-node-{i}", "") for i in range(world // RANKS_PER_POD)]
        suspicions = [
            suspected(FindingKind.STRAGGLER, [straggler], "rank waits far less than its peers"),
            suspected(FindingKind.FAIL_SLOW, [], "step time up"),
        ]
        asked = {s.kind: pods_to_ask(state, s, layout, pods) for s in suspicions}
        wanted = sorted({int(pod.rsplit("-", 1)[1]) for names in asked.values() for pod in names})
        ranks = np.concatenate([np.arange(p * RANKS_PER_POD, (p + 1) * RANKS_PER_POD) for p in wanted])
        rings = work / "rings"
        written = time.perf_counter()
        subset = dataclasses.replace(run.trace, calls=run.trace.calls[np.isin(run.trace.calls["rank"], ranks)])
        ring_of_rank = dict(zip(ranks.tolist(), write_rings(subset, rings, parents=run.parents), strict=True))
        print(f"generated {len(run.trace.calls):,} calls ({args.steps} steps x {args.microbatches} microbatches) "
              f"in {generated:.1f} s; rings of the {len(ranks)} ranks asked written in "
              f"{time.perf_counter() - written:.1f} s", flush=True)  # fmt: skip
        del run, subset
        node_of_rank = {rank: state.node_of_pod(r.pod) or r.node for rank, r in state.ranks.items()}
        request = AnalysisRequest(TP, PP, world, node_of_rank, 1.0)
        print(f"\nbudget per diagnosis: {budget.memory_bytes / MIB:.0f} MiB, {budget.timeout_s:.0f} s; dumps up to "
              f"{budget.dump_bytes / MIB:.0f} MiB")  # fmt: skip
        print(f"{'suspicion':<10} {'pods':>5} {'rec/ring':>8} {'dump MiB':>8} {'worker s':>8} {'peak AS':>8} "
              f"{'peak RSS':>8}  finding")  # fmt: skip
        for suspicion in suspicions:
            names = asked[suspicion.kind]
            limit = records_limit(state, names, 5.0, budget.dump_bytes)
            directory = work / f"dumps-{suspicion.kind.value}"
            size = write_dumps(ring_of_rank, names, limit, directory)
            try:
                result = asyncio.run(analyse(directory, request, budget.memory_bytes, budget.timeout_s))
            except WorkerFailed as failed:
                print(f"{suspicion.kind.value:<10} {len(names):>5} {limit:>8} {size / MIB:>8.1f}  FAILED: {failed}")
                continue
            found = [(f.kind.value, f.ranks[:4], f.nodes[:2]) for f in result.report.findings]
            print(f"{suspicion.kind.value:<10} {len(names):>5} {limit:>8} {size / MIB:>8.1f} {result.seconds:>8.1f} "
                  f"{result.peak_address_space_bytes / MIB:>8.0f} {result.peak_rss_bytes / MIB:>8.0f}  {found} "
                  f"{result.report.problems[:2]}", flush=True)  # fmt: skip
        print(f"expected straggler: rank {straggler} (pod big-worker-{straggler // RANKS_PER_POD})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
