"""Sidecar CPU cost: per million records read and summarised, and its share of a core under load.

1. In process: 8 rings are filled by a vectorised writer (not timed) and the sidecar polls, closes a
   window and encodes the summary (timed, process CPU time) until one million records were read.
2. Under load: a writer process publishes 8 ranks x 5,000 calls/s (each call entered, then finished
   one batch later, as the tracer does) while `rankwatch sidecar` runs as a real subprocess with its
   defaults (0.5 s polls, 5 s windows) and POSTs to a loopback collector; its CPU time comes from
   /proc/<pid>/stat. Target: under 5% of one core. The summaries carry the host figures (each ring's
   process schedstat and status read once per window, the node's /proc/pressure/cpu).
3. Python stacks on a stall: ``--ranks`` Python processes waiting in a function; the sidecar's
   StackTaker takes all their stacks with py-spy (what one stall report costs), wall time and the CPU
   of the py-spy processes.

    python bench/sidecar_cpu.py [--seconds 30] [--ranks 8] [--rate 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from figures import Figure, emit

from rankwatch.analysis.ring import HEADER_DTYPE, HEADER_SIZE, RECORD_DTYPE, Op, State

CAPACITY = 1 << 16
COMMS = np.array([0x1111, 0x2222, 0x3333, 0x4444], dtype=np.uint64)  # TP, DP, PP, world
OPS = np.array([Op.ALLREDUCE, Op.ALLREDUCE, Op.SEND, Op.ALLREDUCE], dtype=np.uint8)


class BatchWriter:
    """Writes calls into a ring file in vectorised batches, publishing them as librankwatch does."""

    def __init__(self, path: Path, rank: int) -> None:
        import mmap

        size = HEADER_SIZE + CAPACITY * RECORD_DTYPE.itemsize
        with open(path, "wb") as handle:
            handle.truncate(size)
        with open(path, "r+b") as handle:
            self.map = mmap.mmap(handle.fileno(), size)
        self.header = np.frombuffer(self.map, HEADER_DTYPE, count=1)
        self.slots = np.frombuffer(self.map, RECORD_DTYPE, count=CAPACITY, offset=HEADER_SIZE)
        h = self.header
        h["version"], h["header_size"], h["record_size"], h["capacity"] = 1, HEADER_SIZE, 128, CAPACITY
        h["pid"], h["global_rank"], h["local_rank"], h["world_size"] = os.getpid(), rank, rank, 8
        h["hostname"], h["start_realtime_ns"], h["start_monotonic_ns"] = b"bench", time.time_ns(), time.monotonic_ns()
        h["magic"] = b"RWRING\0\0"
        self.rank = rank
        self.seq = np.zeros(len(COMMS), np.uint64)
        self.open_slot: int | None = None

    def write(self, n: int, now_ns: int) -> None:
        """``n`` calls; the last stays in flight until the next batch finishes it."""
        if n <= 0:
            return
        if self.open_slot is not None:
            slot = self.slots[self.open_slot : self.open_slot + 1]
            slot["t_return_ns"] = now_ns
            slot["state"] = State.RETURNED
        first = int(self.header["next"][0])
        claims = np.arange(first, first + n, dtype=np.uint64)
        which = (claims % np.uint64(len(COMMS))).astype(np.int64)
        batch = np.zeros(n, RECORD_DTYPE)
        batch["comm_id"], batch["op"] = COMMS[which], OPS[which]
        counts = np.bincount(which, minlength=len(COMMS))
        order = np.argsort(which, kind="stable")
        seq = np.empty(n, np.uint64)
        seq[order] = np.concatenate([self.seq[c] + np.arange(1, counts[c] + 1, dtype=np.uint64) for c in range(4)])
        self.seq += counts.astype(np.uint64)
        batch["seq"], batch["count"], batch["rank"], batch["nranks"] = seq, 4096, self.rank % 2, 2
        batch["global_rank"], batch["peer"] = self.rank, -1
        batch["t_call_ns"] = now_ns - (n - np.arange(n)) * 150_000
        batch["t_return_ns"] = batch["t_call_ns"] + 50_000 + (claims % np.uint64(7)).astype(np.int64) * 10_000
        batch["state"] = State.RETURNED
        batch["t_return_ns"][-1], batch["state"][-1] = 0, State.ENTERED
        batch["stamp"] = claims * np.uint64(2) + np.uint64(2)
        slots = (claims % np.uint64(CAPACITY)).astype(np.int64)
        self.slots[slots] = batch
        self.header["next"] = first + n
        self.open_slot = int(slots[-1])


def per_million(ranks: int) -> dict[str, float]:
    from rankwatch.protocol import encode
    from rankwatch.sidecar.config import load
    from rankwatch.sidecar.main import Sidecar

    with tempfile.TemporaryDirectory() as directory:
        writers = [BatchWriter(Path(directory) / f"rankwatch-bench-{rank}.ring", rank) for rank in range(ranks)]
        sidecar = Sidecar(load(environ={"RANKWATCH_TRACE_DIR": directory, "RANKWATCH_SENSITIVITY_SECONDS": "300"}))
        per_poll = 2_500  # records per ring per poll: 5,000 calls/s and 0.5 s polls
        cpu = polls = read = 0.0
        now = time.time_ns()
        while read < 1_000_000:
            for writer in writers:
                writer.write(per_poll, now)
            now += 500_000_000
            start = time.process_time()
            sidecar.poll(now)
            polls += 1
            if polls % 10 == 0:  # a 5 s window every ten 0.5 s polls
                encode(sidecar.close_window(now))
            cpu += time.process_time() - start
            read = sum(tail.records_read for tail in sidecar.rings.tails.values())
        encode(sidecar.close_window(now))
        sidecar.rings.close()
        return {"records": read, "cpu_seconds": cpu, "cpu_seconds_per_million": cpu / read * 1e6}


def writer_main(directory: str, ranks: int, rate: int, seconds: float) -> None:
    writers = [BatchWriter(Path(directory) / f"rankwatch-bench-{rank}.ring", rank) for rank in range(ranks)]
    period = 0.01
    start = time.monotonic()
    ticks = 0
    while time.monotonic() - start < seconds:
        ticks += 1
        for writer in writers:
            writer.write(int(rate * period), time.time_ns())
        time.sleep(max(0.0, start + ticks * period - time.monotonic()))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def under_load(ranks: int, rate: int, seconds: float) -> dict[str, float]:
    from aiohttp import web

    received = []

    async def collect(request: web.Request) -> web.Response:
        received.append(request.content_length or 0)
        await request.read()
        return web.Response(status=204)

    app = web.Application(client_max_size=16 << 20)
    app.router.add_post("/v1/jobs/{namespace}/{name}/{kind}", collect)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    with tempfile.TemporaryDirectory() as directory:
        token = Path(directory) / "token"
        token.write_text("bench")
        traces = Path(directory) / "traces"
        traces.mkdir()
        warmup = 3.0
        writer = subprocess.Popen(
            [sys.executable, __file__, "--writer", str(traces), str(ranks), str(rate), str(seconds + warmup + 2)]
        )
        await asyncio.sleep(0.5)
        env = {
            **os.environ,
            "RANKWATCH_TRACE_DIR": str(traces),
            "RANKWATCH_COLLECTOR_URL": f"http://127.0.0.1:{port}",
            "RANKWATCH_TOKEN_FILE": str(token),
            "RANKWATCH_METRICS_PORT": "0",
            "RANKWATCH_SENSITIVITY_SECONDS": "300",
        }
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "rankwatch", "sidecar"],
            env=env,
            stderr=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        await asyncio.sleep(warmup)  # start-up (imports) and the first full read are not the steady state
        cpu_before, wall_before = cpu_seconds(sidecar.pid), time.monotonic()
        await asyncio.sleep(seconds)
        cpu_after, wall_after = cpu_seconds(sidecar.pid), time.monotonic()
        sidecar.send_signal(signal.SIGTERM)
        await asyncio.to_thread(sidecar.wait, 30)
        writer.kill()
        writer.wait()
    await runner.cleanup()
    share = (cpu_after - cpu_before) / (wall_after - wall_before)
    return {
        "ranks": ranks,
        "calls_per_second_per_rank": rate,
        "seconds": round(wall_after - wall_before, 1),
        "cpu_share_of_one_core": share,
        "summaries_received": len(received),
        "mean_summary_bytes_gzip": sum(received) / max(1, len(received)),
        "exit_code": sidecar.returncode,
    }


STACK_RANK = "import time\ndef load_batch():\n    time.sleep(3600)\nprint('ready', flush=True)\nload_batch()\n"


def _timed_on_ranks(ranks: int, source: str, action: Callable[[dict[int, int]], Any]) -> tuple[Any, float, float]:
    """Run ``action({rank: pid})`` against ``ranks`` Python processes running ``source`` (each prints
    'ready' first): its result, its wall time and the CPU time its child processes (py-spy) used."""
    import resource

    processes = [subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, text=True)
                 for _ in range(ranks)]  # fmt: skip
    try:
        for process in processes:
            process.stdout.readline()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        result = action({rank: process.pid for rank, process in enumerate(processes)})
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    finally:
        for process in processes:
            process.kill()
            process.wait()
    return result, wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def stack_cost(ranks: int) -> dict[str, float]:
    """Wall and CPU time to take ``ranks`` processes' Python stacks, as the sidecar does for a stall report."""
    from rankwatch.sidecar.python_stacks import StackTaker

    stacks, wall, cpu = _timed_on_ranks(ranks, STACK_RANK, StackTaker().stacks)
    return {"ranks": ranks, "stacks_taken": len(stacks), "wall_seconds": wall, "py_spy_cpu_seconds": cpu}


PROFILED_RANK = (
    "import time\ndef forward():\n    time.sleep(0.0007)\ndef backward():\n    time.sleep(0.0013)\n"
    "print('ready', flush=True)\nwhile True:\n    forward()\n    backward()\n"
)


def profile_cost(ranks: int = 3, seconds: float = 3.0) -> dict[str, float]:
    """Wall and CPU time of one differential profile: ``ranks`` busy Python loops (a culprit and two
    peers) sampled together for ``seconds``, as the sidecar's /profile does."""
    from rankwatch.sidecar.python_profile import Profiler

    profiler = Profiler(min_interval_s=0)
    profiles, wall, cpu = _timed_on_ranks(ranks, PROFILED_RANK, lambda pids: profiler.profile(pids, seconds))
    samples = [profile.samples for profile in profiles.values()]
    return {"ranks": ranks, "seconds": seconds, "wall_seconds": wall, "py_spy_cpu_seconds": cpu,
            "min_samples": min(samples), "max_samples": max(samples)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--rate", type=int, default=5000, help="calls per second per rank (0: an idle sidecar)")
    parser.add_argument("--writer", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--profile-only", action="store_true", help="only the cost of one differential profile")
    args = parser.parse_args()
    if args.profile_only:
        profile = profile_cost()
        p = profile
        print(
            f"differential profile of {p['ranks']} ranks for {p['seconds']:.0f} s: {p['wall_seconds']:.2f} s wall, "
            f"{p['py_spy_cpu_seconds']:.2f} s CPU of py-spy, {p['min_samples']}-{p['max_samples']} samples per rank"
        )
        return
    if args.writer:
        directory, ranks, rate, seconds = args.writer
        writer_main(directory, int(ranks), int(rate), float(seconds))
        return
    million = per_million(args.ranks)
    print(
        f"read + summarise: {million['records']:,} records in {million['cpu_seconds']:.2f} s CPU "
        f"= {million['cpu_seconds_per_million']:.2f} s per million records"
    )
    load = asyncio.run(under_load(args.ranks, args.rate, args.seconds))
    print(
        f"under load: {load['ranks']} ranks x {load['calls_per_second_per_rank']:,} calls/s for {load['seconds']} s: "
        f"sidecar CPU {load['cpu_share_of_one_core']:.1%} of one core (target < 5%); "
        f"{load['summaries_received']} summaries of {load['mean_summary_bytes_gzip']:.0f} B gzip; "
        f"exit code {load['exit_code']}"
    )
    stacks = stack_cost(args.ranks)
    print(
        f"Python stacks of {stacks['ranks']} ranks (one stall report): {stacks['stacks_taken']} taken in "
        f"{stacks['wall_seconds']:.2f} s, {stacks['py_spy_cpu_seconds']:.2f} s CPU of py-spy"
    )
    print(json.dumps({"per_million": million, "under_load": load, "stacks": stacks}))
    emit(Figure("sidecar.cpu_share_at_8x5000", load["cpu_share_of_one_core"], "share of one core"))
    emit(Figure("sidecar.cpu_per_million_records", million["cpu_seconds_per_million"], "s"))


if __name__ == "__main__":
    main()
