"""Fixtures for the sidecar: real rings from `rankwatch simulate`, a loopback collector speaking the
protocol (parsing with the same module the operator uses), a ring writer that follows the tracer's
publication protocol, and an in-process sidecar."""

from __future__ import annotations

import asyncio
import dataclasses
import mmap
import shutil
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from rankwatch import protocol
from rankwatch.analysis.ring import HEADER_DTYPE, HEADER_SIZE, RECORD_DTYPE, Op, State, read_ring
from rankwatch.sidecar.config import load
from rankwatch.sidecar.main import Sidecar
from rankwatch.sidecar.shipper import Backoff, Shipper
from rankwatch.standins.simulate import Simulation, run

TOKEN = "test-token-0123456789"


@pytest.fixture(scope="session")
def healthy_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-rank run (TP 2, PP 2, 10 steps): 138 calls per rank on four communicators."""
    out = tmp_path_factory.mktemp("healthy-run")
    run(Simulation(world_size=4, tp=2, pp=2, steps=10, compute_us=500, ranks_per_node=4), out)
    return out


@pytest.fixture
def trace_dir(healthy_run: Path, tmp_path: Path) -> Path:
    """A private copy of the healthy run's rings."""
    directory = tmp_path / "traces"
    directory.mkdir()
    for ring in healthy_run.glob("*.ring"):
        shutil.copy(ring, directory / ring.name)
    return directory


@pytest.fixture
def token() -> str:
    """The job token the collector (and the sidecar's endpoints) accept."""
    return TOKEN


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


class Collector:
    """The operator's side of the protocol on loopback; ``mode`` decides the answers."""

    def __init__(self) -> None:
        self.summaries: list[protocol.WindowSummary] = []
        self.stalls: list[tuple[float, protocol.StallReport]] = []  # (time received, report)
        self.answers: list[int] = []
        self.script: list[int] = []  # statuses to answer first, one per request (then 204)
        self.delays: list[float] = []  # seconds to wait before answering, one per request (then none)
        self.url = ""
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        status = self.script.pop(0) if self.script else 204
        if self.delays:
            await asyncio.sleep(self.delays.pop(0))
        if status == 204 and protocol.token_of(request.headers.get("Authorization")) != TOKEN:
            status = 401
        if status == 204:
            body = protocol.decode_body(await request.read(), request.headers.get("Content-Encoding"))
            if request.match_info["kind"] == "summaries":
                self.summaries.append(protocol.parse_summary(body))
            else:
                self.stalls.append((time.time(), protocol.parse_stall(body)))
        self.answers.append(status)
        return web.Response(status=status)

    async def start(self, port: int = 0) -> None:
        app = web.Application(client_max_size=protocol.MAX_DECODED_BYTES)
        app.router.add_post("/v1/jobs/{namespace}/{name}/{kind:summaries|stalls}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()

    async def wait_for(self, condition: Callable[[], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; answers so far {self.answers[-20:]}")
            await asyncio.sleep(0.05)


@pytest.fixture
async def collector() -> AsyncIterator[Collector]:
    server = Collector()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
async def make_sidecar(token_file: Path) -> AsyncIterator[Callable[..., Any]]:
    """An in-process sidecar on loopback; ``fast_retries`` shortens the backoff for tests."""
    started: list[Sidecar] = []

    async def make(trace_dir: Path, collector_url: str | None = None, fast_retries: bool = True, **overrides):
        environ = {
            "RANKWATCH_TRACE_DIR": str(trace_dir),
            "RANKWATCH_TOKEN_FILE": str(token_file),
            "RANKWATCH_JOB_NAMESPACE": "team-a",
            "RANKWATCH_JOB_NAME": "llama",
            "POD_NAME": "llama-worker-0",
            "NODE_NAME": "sim-node-0",
            "RANKWATCH_NPROC_PER_NODE": "4",
            "RANKWATCH_METRICS_PORT": "0",
            **({"RANKWATCH_COLLECTOR_URL": collector_url} if collector_url else {}),
        }
        config = dataclasses.replace(load(environ=environ), host="127.0.0.1", **overrides)
        sidecar = Sidecar(config)
        if sidecar.shipper and fast_retries:
            sidecar.shipper = Shipper(
                config.collector_url,
                config.namespace,
                config.job,
                sidecar.token,
                queue_size=config.queue_size,
                timeout=config.post_timeout_s,
                backoff=Backoff(initial=0.05, cap=0.2),
            )
        await sidecar.start()
        started.append(sidecar)
        return sidecar

    yield make
    for sidecar in started:
        await sidecar.close()


class RingWriter:
    """Writes a ring file as librankwatch does: claim, stamp odd, fill, state, stamp even; finish later."""

    def __init__(self, path: Path, rank: int, pid: int, capacity: int = 64, host: str = "test-node") -> None:
        self.path = path
        size = HEADER_SIZE + capacity * RECORD_DTYPE.itemsize
        with open(path, "wb") as handle:
            handle.truncate(size)
        with open(path, "r+b") as handle:
            self._map = mmap.mmap(handle.fileno(), size)
        self.header = np.frombuffer(self._map, HEADER_DTYPE, count=1)
        self.slots = np.frombuffer(self._map, RECORD_DTYPE, count=capacity, offset=HEADER_SIZE)
        h = self.header
        h["version"], h["header_size"], h["record_size"], h["capacity"] = 1, HEADER_SIZE, 128, capacity
        h["pid"], h["global_rank"], h["local_rank"], h["world_size"] = pid, rank, rank, 8
        h["hostname"], h["start_realtime_ns"] = host.encode(), time.time_ns()
        h["start_monotonic_ns"] = time.monotonic_ns()
        h["magic"] = b"RWRING\0\0"
        self.capacity = capacity
        self.rank = rank
        self.seq: dict[int, int] = {}

    def call(self, comm: int = 0xC0FFEE, op: int = Op.ALLREDUCE, finish: bool = True, wait_ns: int = 1000) -> int:
        index = int(self.header["next"][0])
        self.header["next"] = index + 1
        slot = self.slots[index % self.capacity : index % self.capacity + 1]
        slot["stamp"] = 2 * index + 1
        self.seq[comm] = self.seq.get(comm, 0) + 1
        slot["comm_id"], slot["seq"], slot["op"], slot["count"] = comm, self.seq[comm], op, 1024
        slot["rank"], slot["nranks"], slot["global_rank"], slot["peer"] = self.rank, 8, self.rank, -1
        slot["t_call_ns"], slot["t_return_ns"], slot["gpu_start_ns"], slot["gpu_end_ns"] = time.time_ns(), 0, 0, 0
        slot["state"] = State.ENTERED
        slot["stamp"] = 2 * index + 2
        if finish:
            self.finish(index, wait_ns)
        return index

    def finish(self, index: int, wait_ns: int = 1000) -> None:
        slot = self.slots[index % self.capacity : index % self.capacity + 1]
        slot["t_return_ns"] = slot["t_call_ns"] + wait_ns
        slot["state"] = State.RETURNED

    def close(self) -> None:
        del self.header, self.slots
        self._map.close()


@pytest.fixture
def ring_writer() -> type[RingWriter]:
    return RingWriter


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    import subprocess

    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


@pytest.fixture
def ring_calls() -> Callable[[Path], dict[tuple[int, str, str], int]]:
    """(rank, communicator, op) -> calls, counted from the ring files of a directory."""

    def count(directory: Path) -> dict[tuple[int, str, str], int]:
        counts: Counter = Counter()
        for path in directory.glob("*.ring"):
            snapshot = read_ring(path)
            records = snapshot.records
            calls = records[(records["op"] >= Op.ALLREDUCE) & (records["op"] <= Op.RECV)]
            for comm, op in zip(calls["comm_id"].tolist(), calls["op"].tolist(), strict=True):
                counts[(snapshot.header.global_rank, f"{comm:016x}", protocol.OP_NAMES[op])] += 1
        return dict(counts)

    return count


@pytest.fixture
def summarised_calls() -> Callable[[list[protocol.WindowSummary]], dict[tuple[int, str, str], int]]:
    """(rank, communicator, op) -> calls, summed over summaries (each window once, however often delivered)."""

    def count(summaries: list[protocol.WindowSummary]) -> dict[tuple[int, str, str], int]:
        counts: Counter = Counter()
        for summary in {s.window: s for s in summaries}.values():
            for rank in summary.ranks:
                for comm in rank.comms:
                    for op, n in comm.calls.items():
                        counts[(rank.global_rank, comm.comm_id, op)] += n
        return dict(counts)

    return count
