"""Memory of a diagnosis's analysis worker against the size of the dumps it analyses.

Simulated 8-rank jobs (TP 4, a straggler) of growing length, their rings as the sidecars' /dump
answers them, analysed by the operator's worker (``rankwatch.operator.diagnosis.diagnose.worker``) with no
budget to speak of. Prints, per dump size, the worker's peak address space (what its budget,
RLIMIT_AS, is measured against) and peak RSS, the worker's floor (a dump of one tiny ring), and the
ratio of the growth to the dump: the basis of ``DUMP_SHARE_OF_WORKER_MEMORY`` in
operator/diagnosis/diagnose/diagnose.py.

    .venv/bin/python bench/diagnosis_memory.py
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from rankwatch.operator.diagnosis.diagnose.diagnose import DUMP_SHARE_OF_WORKER_MEMORY
from rankwatch.operator.diagnosis.diagnose.worker import AnalysisRequest, analyse
from rankwatch.sidecar.dump import ring_image, select
from rankwatch.sidecar.ring_tail import RingTail
from rankwatch.standins.simulate import Faults, Simulation, run

MIB = 1 << 20


def dump(rings: list[Path], directory: Path, records: int | None = None) -> int:
    directory.mkdir(parents=True)
    path = directory / "job-worker-0.dump"
    with path.open("wb") as out:
        for ring in rings:
            tail = RingTail(ring)
            chosen, _ = select(tail, 0, records or 1 << 30)
            out.write(ring_image(tail, np.ascontiguousarray(chosen)))
    return path.stat().st_size


def main() -> int:
    request = AnalysisRequest(4, 1, 8, {}, 1.0)
    work = Path(tempfile.mkdtemp(prefix="rankwatch-bench-"))
    try:
        rows = []
        for steps in (750, 3000, 7000):
            out = work / f"sim-{steps}"
            run(Simulation(world_size=8, tp=4, steps=steps, compute_us=50, ranks_per_node=4,
                           faults=Faults(slow_rank=5, slowdown=1.0)), out, log=lambda *_: None)  # fmt: skip
            rings = [Path(r["ring"]) for r in json.loads((out / "simulation.json").read_text())["ranks"]]
            if not rows:
                size = dump(rings[:1], work / "floor", records=16)
                floor = asyncio.run(analyse(work / "floor", request, 4 << 30, 600))
                rows.append(("floor (16 records)", size, floor))
            size = dump(rings, work / f"dump-{steps}")
            result = asyncio.run(analyse(work / f"dump-{steps}", request, 4 << 30, 600))
            found = [(f.kind.value, f.ranks) for f in result.report.findings]
            rows.append((f"{steps} steps, 8 ranks {found}", size, result))
        base = rows[0][2]
        print(
            f"{'dumps':<44} {'dump MiB':>9} {'peak AS MiB':>12} {'peak RSS MiB':>13} {'AS growth / dump':>17} {'s':>6}"
        )
        for name, size, result in rows:
            growth = (result.peak_address_space_bytes - base.peak_address_space_bytes) / max(size, 1)
            print(f"{name:<44} {size / MIB:>9.1f} {result.peak_address_space_bytes / MIB:>12.0f} "
                  f"{result.peak_rss_bytes / MIB:>13.0f} {growth:>17.2f} {result.seconds:>6.1f}")  # fmt: skip
        print(
            f"DUMP_SHARE_OF_WORKER_MEMORY = {DUMP_SHARE_OF_WORKER_MEMORY}: a 256 MiB worker fetches at most "
            f"{int(256 * DUMP_SHARE_OF_WORKER_MEMORY)} MiB of dumps"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
