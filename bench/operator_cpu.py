"""Operator CPU while ingesting the window summaries of a 1,000-rank job.

A child process runs the operator's collector (the real aiohttp app, token check, gzip, protocol
parsing, dedupe, job state) and runs the detector over the job after every window, as the monitor
does; the parent plays 125 sidecars (8 ranks each, 4 communicators per rank: TP 8, DP, PP, world)
and POSTs one summary per pod per window over loopback, built and gzip'd with the protocol module
beforehand (the parent's cost is not measured). The child's CPU comes from /proc/<pid>/stat.
Windows are sent faster than real time (``--window-seconds``, default 1 s) and the cost is given
per window and as a share of one core at the default 5 s window.

    python bench/operator_cpu.py [--ranks 1000] [--windows 20] [--window-seconds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import time
from collections.abc import Sequence

import aiohttp
from figures import Figure, emit

from rankwatch import protocol
from rankwatch.operator.api import worker_pod_name
from rankwatch.protocol import CommWindow, Quantiles, RankWindow, WindowSummary

TOKEN = "bench-token"
RANKS_PER_POD = 8
TP, PP = 8, 4


def comms_of(rank: int, world: int, pipeline: int = PP) -> list[tuple[str, int, int]]:
    dp_size = world // (TP * pipeline)
    tp, dp, pp = rank % TP, (rank // TP) % dp_size, rank // (TP * dp_size)
    return [
        (f"{0x1000000 + dp + dp_size * pp:016x}", tp, TP),
        (f"{0x2000000 + tp + TP * pp:016x}", dp, dp_size),
        (f"{0x3000000 + tp + TP * dp:016x}", pp, pipeline),
        (f"{0x4000000:016x}", rank, world),
    ]


def summaries(
    world: int,
    window: int,
    generator: random.Random,
    pipeline: int = PP,
    namespace: str = "bench",
    job: str = "big",
    nodes: Sequence[str] | None = None,
) -> list[tuple[str, bytes]]:
    """(pod, gzip'd body) of every pod of job ``namespace/job`` (``world`` ranks, TP 8 x ``pipeline``) in a
    window; pods named as the operator names them, pod ``i`` on ``nodes[i]`` (``gpu-node-<i>`` without)."""
    bodies = []
    for pod in range(world // RANKS_PER_POD):
        ranks = []
        for rank in range(pod * RANKS_PER_POD, (pod + 1) * RANKS_PER_POD):
            comms = []
            for comm_id, comm_rank, size in comms_of(rank, world, pipeline):
                wait = 0.001 * generator.uniform(0.7, 1.3)
                seq = 100 * window
                comms.append(
                    CommWindow(comm_id, comm_rank, size, seq - 99, seq, seq - 99, seq, 0, None,
                               {"AllReduce": 100}, 0, Quantiles(100, wait, wait * 1.5, wait * 2, wait * 3),
                               Quantiles(100, 0.02, 0.021, 0.03, 0.04), None)
                )  # fmt: skip
            ranks.append(RankWindow(rank, rank % 8, 1000 + rank, f"r{rank}.ring", True, 600, 0, 0, 0,
                                    time.time_ns(), 0.021, comms))  # fmt: skip
        node = nodes[pod] if nodes is not None else f"gpu-node-{pod}"
        summary = WindowSummary(1, namespace, job, worker_pod_name(job, pod), node, pod, RANKS_PER_POD,
                                window, window * 10**9, (window + 1) * 10**9, 0, ranks)  # fmt: skip
        bodies.append((summary.pod, protocol.encode(summary)))
    return bodies


def serve(port_queue: multiprocessing.Queue, world: int, window_s: float, detect_times: multiprocessing.Queue) -> None:
    from rankwatch.analysis.topology import Layout
    from rankwatch.operator.config import CollectorSettings
    from rankwatch.operator.diagnosis.detect.detector import Thresholds, detect
    from rankwatch.operator.diagnosis.ingest.collector import Collector
    from rankwatch.operator.diagnosis.ingest.job_state import JobStore, StateLimits

    async def tokens(namespace: str, name: str, stale: bool = False) -> str:
        return TOKEN

    limits = StateLimits.for_job(world, world // RANKS_PER_POD)

    async def main() -> None:
        store = JobStore()
        collector = Collector(store, tokens, CollectorSettings(host="127.0.0.1", port=0, rate_per_job=1e6,
                                                                 burst_per_job=1e6),
                              jobs=lambda namespace, name: limits)  # fmt: skip
        await collector.start()
        port_queue.put(collector.port)
        layout = Layout(TP, PP, world)
        thresholds = Thresholds(300, 5)
        while True:  # the monitor: the detector once per window
            await asyncio.sleep(window_s)
            state = store.peek("bench", "big")
            if state is not None:
                started = time.perf_counter()
                found = detect(state, thresholds, layout, time.monotonic())
                detect_times.put((time.perf_counter() - started, len(found)))

    asyncio.run(main())


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def send(port: int, windows: list[list[tuple[str, bytes]]], window_s: float) -> int:
    url = f"http://127.0.0.1:{port}{protocol.summaries_path('bench', 'big')}"
    headers = {"Authorization": protocol.bearer(TOKEN), "Content-Encoding": "gzip", "Content-Type": "application/json"}
    failures = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32)) as session:
        for bodies in windows:
            started = time.monotonic()
            spacing = window_s * 0.8 / len(bodies)  # sidecars' windows are not aligned: spread them

            async def post(body: bytes, delay: float) -> int:
                await asyncio.sleep(delay)
                async with session.post(url, data=body, headers=headers) as response:
                    return response.status

            statuses = await asyncio.gather(*(post(body, i * spacing) for i, (_, body) in enumerate(bodies)))
            failures += sum(status != 202 for status in statuses)
            await asyncio.sleep(max(0.0, window_s - (time.monotonic() - started)))
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=1000)
    parser.add_argument("--windows", type=int, default=20)
    parser.add_argument("--window-seconds", type=float, default=1.0)
    args = parser.parse_args()
    unit = RANKS_PER_POD * TP * PP
    world = -(-args.ranks // unit) * unit  # rounded up to whole TP x PP x pod blocks
    generator = random.Random(0)
    print(f"building {args.windows} windows x {world // RANKS_PER_POD} summaries of {world} ranks ...")
    windows = [summaries(world, number + 1, generator) for number in range(args.windows)]
    size = sum(len(body) for _, body in windows[0]) / len(windows[0])

    context = multiprocessing.get_context("spawn")
    ports, detect_times = context.Queue(), context.Queue()
    child = context.Process(target=serve, args=(ports, world, args.window_seconds, detect_times))
    child.start()
    port = ports.get(timeout=30)
    time.sleep(1.0)
    before, wall = cpu_seconds(child.pid), time.monotonic()
    failures = asyncio.run(send(port, windows, args.window_seconds))
    cpu, elapsed = cpu_seconds(child.pid) - before, time.monotonic() - wall
    child.terminate()  # its parsing workers end with it (not a daemon: a daemon may not start them)
    child.join(10)
    detections = []
    while not detect_times.empty():
        detections.append(detect_times.get())
    per_window = cpu / args.windows
    print(f"{world} ranks, {len(windows[0])} pods, 4 communicators per rank; summary {size / 1024:.1f} KiB gzip'd")
    print(f"{args.windows} windows in {elapsed:.1f} s; refused: {failures}")
    print(f"operator CPU: {cpu:.2f} s = {per_window * 1e3:.0f} ms per window ({per_window / len(windows[0]) * 1e3:.2f} "
          f"ms per summary); at 5 s windows: {100 * per_window / 5:.1f}% of one core")  # fmt: skip
    emit(Figure(f"operator.cpu_per_window.{world}_ranks", per_window * 1e3, "ms"))
    if detections:
        worst = max(seconds for seconds, _ in detections)
        print(f"detector over the job: {1e3 * sum(s for s, _ in detections) / len(detections):.1f} ms mean, "
              f"{worst * 1e3:.1f} ms max; suspicions raised: {sum(n for _, n in detections)}")  # fmt: skip


if __name__ == "__main__":
    main()
