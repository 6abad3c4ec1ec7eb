"""The operator's memory while it archives a large evidence set (issue 27 row 1).

Sixteen sidecars answer ``/dump`` with 128 MiB each (2 GiB in all: valid ring images of a simulated
8-rank straggler job, its records repeated), served by a process of their own on loopback so that
only the archiving side is measured here. This process plays the operator: it runs
``evidence.collect`` (streaming to disk within the archive's byte budget; cutting and rendering in
the bounded worker) and ``archive.upload`` to a real MinIO, sampling its own RSS every 20 ms.
Prints the RSS rise over the start, the worker's peak, the archive's size and the problems the
job's status would show.

    .venv/bin/python bench/evidence_memory.py [--budget-mib 512] [--pods 16] [--dump-mib 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from rankwatch.operator.recovery import archive, evidence
from rankwatch.operator.sidecar_client import SidecarPod
from rankwatch.operator.spec import S3Archive
from rankwatch.sidecar.dump import ring_image, select
from rankwatch.sidecar.ring_tail import RingTail
from rankwatch.standins.simulate import Faults, Simulation, run

MIB = 1 << 20
TOKEN = "bench-token"
BUCKET = "evidence"


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def write_dump(path: Path, rings: list[Path], size: int) -> None:
    """One pod's /dump answer of about ``size`` bytes: its rings' records tiled to fill it."""
    tails = [RingTail(ring) for ring in rings]
    records = [select(tail, 0, 1 << 30)[0] for tail in tails]
    per_ring = size // len(rings)
    with path.open("wb") as out:
        for tail, chosen in zip(tails, records, strict=True):
            repeat = max(1, per_ring // max(1, chosen.nbytes))
            out.write(ring_image(tail, np.tile(chosen, repeat)))


def serve_sidecars(dump: str, ready: multiprocessing.Queue) -> None:
    """Every pod's sidecar, in one process: /dump streams the file; /evidence has nothing (404)."""
    from aiohttp import web

    async def dump_handler(_: web.Request) -> web.StreamResponse:
        return web.FileResponse(dump)

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/dump", dump_handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        ready.put(runner.addresses[0][1])
        await asyncio.Event().wait()

    asyncio.run(main())


class RssSampler:
    def __init__(self) -> None:
        self.start = _rss()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=int, default=512, help="the archive's byte budget (chart default)")
    parser.add_argument("--pods", type=int, default=16)
    parser.add_argument("--dump-mib", type=int, default=128)
    parser.add_argument(
        "--worker-mib", type=int, default=256, help="the worker's memory (chart: diagnosis.memoryMiB / concurrency)"
    )
    args = parser.parse_args()
    from rankwatch.analysis.archive import s3_client
    from rankwatch.cluster.s3_server import S3Server

    work = Path(tempfile.mkdtemp(prefix="rankwatch-bench-evidence-"))
    spawn = multiprocessing.get_context("spawn")
    try:
        sim = work / "sim"
        run(Simulation(world_size=8, tp=4, steps=3000, compute_us=50, ranks_per_node=4,
                       faults=Faults(slow_rank=5, slowdown=1.0)), sim, log=lambda *_: None)  # fmt: skip
        rings = [Path(r["ring"]) for r in json.loads((sim / "simulation.json").read_text())["ranks"]]
        dump = work / "pod.dump"
        write_dump(dump, rings, args.dump_mib * MIB)
        ready: multiprocessing.Queue = spawn.Queue()
        sidecars = spawn.Process(target=serve_sidecars, args=(str(dump), ready), daemon=True)
        sidecars.start()
        port = ready.get(timeout=60)
        pods = [SidecarPod(f"job-worker-{i}", f"node-{i}", f"http://127.0.0.1:{port}") for i in range(args.pods)]
        served = args.pods * dump.stat().st_size
        with S3Server(work / "minio") as s3:
            s3_client(s3.endpoint, "us-east-1", s3.access_key, s3.secret_key).create_bucket(Bucket=BUCKET)
            target = S3Archive(bucket=BUCKET, secretRef="s", endpoint=s3.endpoint)
            credentials = archive.S3Credentials(s3.access_key, s3.secret_key)
            limits = evidence.EvidenceLimits(args.budget_mib * MIB, args.worker_mib * MIB, 600.0)
            manifest = evidence.Manifest("team-a", "job", "uid", 0, "Hang", "2026-11-28T12:00:00Z")
            directory = work / "evidence"
            started = time.monotonic()
            with RssSampler() as rss:
                asyncio.run(evidence.collect(directory, manifest, pods, TOKEN, None, None, args.pods * 4, limits))
                kept = sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())
                path = archive.upload(directory, target, credentials, "rankwatch/team-a/job/uid/attempt-0/bench")
            seconds = time.monotonic() - started
        sidecars.terminate()
        print(f"served by {args.pods} sidecars: {served / MIB:.0f} MiB; archive budget {args.budget_mib} MiB; "
              f"worker {args.worker_mib} MiB")  # fmt: skip
        print(f"operator RSS: start {rss.start / MIB:.0f} MiB, peak {rss.peak / MIB:.0f} MiB, "
              f"rise {(rss.peak - rss.start) / MIB:.1f} MiB")  # fmt: skip
        print(f"archive: {kept / MIB:.0f} MiB in {len(manifest.files)} files at {path} in {seconds:.1f} s; "
              f"report.html: {(directory / 'report.html').exists()}; findings: "
              f"{[(f['kind'], f['ranks']) for f in manifest.findings]}")  # fmt: skip
        print(f"problems ({len(manifest.problems)}):")
        for problem in sorted(set(manifest.problems)):
            print(f"  {problem} (x{manifest.problems.count(problem)})")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
