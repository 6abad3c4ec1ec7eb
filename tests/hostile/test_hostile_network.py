"""Hostile network input against the real collector and the real sidecar, each a process of its own on
loopback: unauthenticated, wrong token, oversized, slow (slowloris), malformed, replayed, at a high but
bounded rate. Neither crashes, memory stays bounded, every refusal is a clear 4xx (or 503 "busy, retry"),
and legitimate traffic is served throughout: a real sidecar ships its summaries to the collector
while the attacks run, and the job's own requests are answered promptly.

Bounded: a few thousand requests, the whole module well under a minute."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

import aiohttp
import pytest

from rankwatch import protocol
from rankwatch.analysis.ring import HEADER_DTYPE
from rankwatch.protocol import CommWindow, Quantiles, RankWindow, WindowSummary
from rankwatch.standins.simulate import Simulation, run

TOKEN = "hostile-test-token-0123456789"
IDLE_S = 2.0  # both servers close a connection without a complete request after this long
SUMMARIES = protocol.summaries_path("team-a", "llama")
HERE = Path(__file__).parent
AUTHORIZATION = f"Authorization: Bearer {TOKEN}"
SENT: Counter = Counter()


def session() -> aiohttp.ClientSession:
    """A new connection per request (no keep-alive: the servers close idle ones after IDLE_S, and a
    pooled connection closed just then would be a client-side race, not what is tested)."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=30), connector=aiohttp.TCPConnector(force_close=True, limit=100)
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def memory_kib(pid: int) -> tuple[int, int]:
    """(resident now, peak resident) of a process, KiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def collector_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, str]]:
    log = tmp_path_factory.mktemp("collector") / "collector.log"
    env = {**os.environ, "HOSTILE_TOKEN": TOKEN, "HOSTILE_BODY_TIMEOUT": "2", "HOSTILE_IDLE_TIMEOUT": str(IDLE_S),
           "HOSTILE_RATE": "1000", "HOSTILE_BURST": "1000000"}  # fmt: skip
    with open(log, "wb") as errors:
        process = subprocess.Popen(
            [sys.executable, str(HERE / "collector_process.py")], stdout=subprocess.PIPE, stderr=errors, env=env
        )
    line = process.stdout.readline().decode()
    assert line.startswith("port "), f"collector did not start: {log.read_text()}"
    yield process, f"http://127.0.0.1:{int(line.split()[1])}"
    stop(process)
    text = log.read_text()
    assert "Traceback" not in text, f"the collector logged a traceback:\n{text[-3000:]}"


@pytest.fixture(scope="module")
def sidecar_process(
    collector_process: tuple[subprocess.Popen, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[subprocess.Popen, str]]:
    """A real sidecar over a finished 4-rank run, shipping 1 s windows to the collector above."""
    base = tmp_path_factory.mktemp("sidecar")
    run(Simulation(world_size=4, tp=2, pp=2, steps=10, compute_us=500, ranks_per_node=4), base / "run")
    traces = base / "traces"
    traces.mkdir()
    pid_at = HEADER_DTYPE.fields["pid"][1]
    for ring in (base / "run").glob("*.ring"):
        data = bytearray(ring.read_bytes())  # the writer is this test process: the rings stay followed
        data[pid_at : pid_at + HEADER_DTYPE["pid"].itemsize] = os.getpid().to_bytes(
            HEADER_DTYPE["pid"].itemsize, "little"
        )
        (traces / ring.name).write_bytes(bytes(data))
    (base / "token").write_text(TOKEN + "\n")
    port = free_port()
    env = {
        **os.environ,
        "RANKWATCH_TRACE_DIR": str(traces),
        "RANKWATCH_TOKEN_FILE": str(base / "token"),
        "RANKWATCH_COLLECTOR_URL": collector_process[1],
        "RANKWATCH_JOB_NAMESPACE": "team-a",
        "RANKWATCH_JOB_NAME": "llama",
        "POD_NAME": "llama-worker-0",
        "NODE_NAME": "node-0",
        "RANKWATCH_NPROC_PER_NODE": "4",
        "RANKWATCH_WINDOW_SECONDS": "1",
        "RANKWATCH_METRICS_PORT": str(port),
    }
    with open(base / "sidecar.log", "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "rankwatch", "sidecar", "--host", "127.0.0.1", "--poll-seconds", "0.2",
             "--idle-timeout-seconds", str(IDLE_S)],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, (base / "sidecar.log").read_text()
            time.sleep(0.1)
    yield process, url
    stop(process)
    assert "Traceback" not in (base / "sidecar.log").read_text()


def summary(window: int, pod: str = "attacker-pod", ranks: int = 1) -> WindowSummary:
    comm = CommWindow("00000000000000ab", 0, 2, 1, 10, 1, 10, 0, None, {"AllReduce": 10}, 0,
                      Quantiles(10, 0.001, 0.001, 0.001, 0.001), None, None)  # fmt: skip
    rank_windows = [RankWindow(r, r, 42, f"r{r}.ring", True, 20, 0, 0, 0, 1, 0.02, [comm]) for r in range(ranks)]
    return WindowSummary(1, "team-a", "llama", pod, "node-9", 1, 1, window, 10**9 * window, 10**9 * (window + 1), 0,
                         rank_windows)  # fmt: skip


async def statuses(
    session: aiohttp.ClientSession, requests: list[tuple[str, str, dict, bytes | None]], concurrency: int = 48
) -> Counter:
    """Send every (method, url, headers, body) with at most ``concurrency`` at once; count the statuses
    (a refused or reset connection counts as 0)."""
    semaphore = asyncio.Semaphore(concurrency)
    counts: Counter = Counter()
    SENT["requests"] += len(requests)

    async def one(method: str, url: str, headers: dict, body: bytes | None) -> None:
        async with semaphore:
            try:
                async with session.request(method, url, headers=headers, data=body) as response:
                    await response.read()
                    counts[response.status] += 1
                    if response.status >= 500 and response.status != 503:
                        counts[f"{response.status}: {(await response.text())[:200]}"] += 1
            except aiohttp.ClientError:
                counts[0] += 1

    await asyncio.gather(*(one(*request) for request in requests))
    return counts


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": protocol.bearer(token)}


async def accepted_summaries(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    found = re.search(r'rankwatch_collector_messages_total\{kind="summary",result="accepted"\} (\S+)', text)
    return float(found.group(1)) if found else 0.0


async def legit_round_trip(session: aiohttp.ClientSession, url: str, window: int) -> float:
    """Seconds for the job's own summary to be taken (202)."""
    started = time.monotonic()
    async with session.post(url + SUMMARIES, data=protocol.encode(summary(window, pod="llama-worker-1")),
                            headers={**bearer(), "Content-Encoding": "gzip"}) as response:  # fmt: skip
        assert response.status == 202, await response.text()
    return time.monotonic() - started


async def slowloris(
    port: int, connections: int, partial: bytes
) -> tuple[list[asyncio.StreamReader], list[asyncio.StreamWriter]]:
    readers, writers = [], []
    for _ in range(connections):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(partial)
        readers.append(reader)
        writers.append(writer)
    await asyncio.gather(*(writer.drain() for writer in writers))
    return readers, writers


async def closed_by_server(writer: asyncio.StreamWriter, reader_timeout: float) -> bool:
    """True when the server ends the connection (EOF or reset) within ``reader_timeout``, while the client
    trickles one more header byte a second."""
    transport = writer.transport
    deadline = time.monotonic() + reader_timeout
    while time.monotonic() < deadline:
        if transport.is_closing():
            return True
        try:
            writer.write(b"X")
            await writer.drain()
        except (ConnectionError, OSError):
            return True
        await asyncio.sleep(0.25)
    return transport.is_closing()


async def test_the_collector_survives_hostile_clients_and_keeps_serving_its_job(collector_process, sidecar_process):
    process, url = collector_process
    port = int(url.rsplit(":", 1)[1])
    started, first = time.monotonic(), SENT["requests"]
    async with session() as client:
        await asyncio.sleep(2.5)  # the sidecar's first windows arrive
        assert await accepted_summaries(client, url) > 0, "the real sidecar's summaries are taken"
        rss_before, _ = memory_kib(process.pid)
        shipped_before = await accepted_summaries(client, url)
        body = protocol.encode(summary(1))
        gz = {"Content-Encoding": "gzip"}

        # Slow clients first, so that everything below runs while they hold their connections.
        _, header_trickle = await slowloris(port, 100, f"POST {SUMMARIES} HTTP/1.1\r\nHost: x\r\n".encode())
        slow_body = f"POST {SUMMARIES} HTTP/1.1\r\nHost: x\r\n{AUTHORIZATION}\r\nContent-Length: 100000\r\n\r\n{{"
        body_readers, body_trickle = await slowloris(port, 20, slow_body.encode())

        # Unauthenticated, wrong token, made-up jobs: 401, and nothing kept.
        requests = [("POST", url + SUMMARIES, gz, body)] * 500
        requests += [("POST", url + SUMMARIES, {**gz, **bearer("guess")}, body)] * 500
        requests += [("POST", url + protocol.summaries_path("team-a", f"job-{i}"), {**gz, **bearer()}, body)
                     for i in range(1000)]  # fmt: skip
        counts = await statuses(client, requests)
        assert counts == Counter({401: 2000}), counts

        # Oversized: a 2 MiB declared body (413 before reading), gzip bombs at once (413, or 503 while
        # the shared budget is held by others).
        bomb = gzip.compress(b" " * (protocol.MAX_DECODED_BYTES + 1), compresslevel=9)
        big = b"x" * (2 << 20)
        requests = [("POST", url + SUMMARIES, {**gz, **bearer()}, bomb)] * 24
        requests += [("POST", url + SUMMARIES, bearer(), big)] * 8
        counts = await statuses(client, requests, concurrency=32)
        assert set(counts) <= {413, 503} and counts[413] >= 8, counts

        # Malformed, at a high rate: random bytes, broken gzip, non-JSON, wrong types, NaN, deep nesting,
        # oversized integers, unknown encodings: each a 4xx, never a 5xx.
        rng = random.Random(19)
        document = asdict(summary(2))
        malformed = [rng.randbytes(rng.randrange(0, 4096)) for _ in range(600)]
        malformed += [b"\x1f\x8b" + rng.randbytes(200) for _ in range(200)]
        malformed += [b"[" * 100_000, b"1" * 5000, b"{}", b"null", json.dumps({**document, "ranks": "all"}).encode(),
                      json.dumps(document).replace("0.001", "NaN", 1).encode(),
                      json.dumps({**document, "start_ns": "soon"}).encode()]  # fmt: skip
        requests = [("POST", url + SUMMARIES, bearer(), item) for item in malformed]
        requests += [("POST", url + SUMMARIES, {**bearer(), "Content-Encoding": "br"}, body)] * 50
        requests += [
            ("POST", url + protocol.stalls_path("team-a", "llama"), bearer(), item) for item in malformed[:300]
        ]
        counts = await statuses(client, requests, concurrency=64)
        assert set(counts) <= {400, 413, 422}, counts

        # Replayed: the same window again is acknowledged once (208); an older one is refused (409); a
        # rank outside the world size is refused (422).
        fresh = summary(100, pod="llama-worker-1")
        requests = [("POST", url + SUMMARIES, {**gz, **bearer()}, protocol.encode(fresh))]
        assert await statuses(client, requests) == Counter({202: 1})
        assert await statuses(client, requests * 20) == Counter({208: 20})
        old = [("POST", url + SUMMARIES, {**gz, **bearer()}, protocol.encode(replace(fresh, window=w, start_ns=w)))
               for w in range(1, 21)]  # fmt: skip
        assert await statuses(client, old) == Counter({409: 20})
        outside = protocol.encode(summary(101, pod="llama-worker-1", ranks=17))
        assert await statuses(client, [("POST", url + SUMMARIES, {**gz, **bearer()}, outside)]) == Counter({422: 1})

        # The job's own traffic is served promptly, the slow clients notwithstanding.
        latency = max([await legit_round_trip(client, url, 200 + i) for i in range(10)])
        assert latency < 1.0, latency

        # Slow clients were cut off: the header tricklers when idle, the body tricklers with 408.
        closed = await asyncio.gather(*(closed_by_server(w, IDLE_S + 4) for w in header_trickle))
        assert all(closed), f"{closed.count(False)} of {len(closed)} slow header connections still open"
        answers = await asyncio.gather(*(asyncio.wait_for(reader.read(200), 6) for reader in body_readers))
        assert all(answer.startswith(b"HTTP/1.1 408") for answer in answers), answers
        ends = await asyncio.gather(*(asyncio.wait_for(reader.read(), 6) for reader in body_readers))
        assert len(ends) == len(body_readers), "each slow body connection was closed after its 408"
        for writer in header_trickle + body_trickle:
            writer.close()

        # Alive, bounded, and the real sidecar's summaries kept being taken.
        async with client.get(url + "/healthz") as response:
            assert response.status == 200
        assert await accepted_summaries(client, url) > shipped_before
        rss_after, peak = memory_kib(process.pid)
    sent = SENT["requests"] - first + 120  # and 120 slow connections
    print(f"\ncollector: {sent} hostile requests in {time.monotonic() - started:.1f} s, resident "
          f"{rss_before >> 10} -> {rss_after >> 10} MiB (peak {peak >> 10} MiB), slowest own summary "
          f"{latency * 1000:.0f} ms")  # fmt: skip
    assert process.poll() is None
    assert rss_after - rss_before < 120 << 10, f"resident memory grew {(rss_after - rss_before) >> 10} MiB"
    assert peak < rss_before + (200 << 10), f"peak {peak >> 10} MiB from {rss_before >> 10} MiB"
    assert time.monotonic() - started < 50


async def test_the_sidecar_dump_refuses_strangers_and_bad_requests_and_keeps_serving(sidecar_process):
    process, url = sidecar_process
    port = int(url.rsplit(":", 1)[1])
    first = SENT["requests"]
    async with session() as client:
        rss_before, _ = memory_kib(process.pid)
        _, trickle = await slowloris(port, 100, b"GET /dump HTTP/1.1\r\nHost: x\r\n")
        dump = url + protocol.DUMP_PATH
        requests = [("GET", dump, {}, None)] * 800 + [("GET", dump, bearer("guess"), None)] * 800
        requests += [("GET", url + protocol.EVIDENCE_PATH, bearer("guess"), None)] * 200
        assert await statuses(client, requests) == Counter({401: 1800})
        bad = ["limit=abc", "limit=0", f"limit={10**9}", "since=-1", "rank=-5", f"rank={2**40}", "since=1e9"]
        requests = [("GET", f"{dump}?{query}", bearer(), None) for query in bad] * 30
        counts = await statuses(client, requests)
        assert counts == Counter({400: len(requests)}), counts
        huge_header = {**bearer(), "X-Filler": "a" * 100_000}
        counts = await statuses(client, [("GET", dump, huge_header, None)] * 20)
        assert set(counts) <= {400, 431, 0} and not counts[200], counts
        async with client.get(dump, headers=bearer(), params={"limit": "50"}) as response:
            assert response.status == 200 and len(await response.read()) > 0
        closed = await asyncio.gather(*(closed_by_server(w, IDLE_S + 4) for w in trickle))
        assert all(closed), f"{closed.count(False)} of {len(closed)} slow connections still open"
        for writer in trickle:
            writer.close()
        async with client.get(url + protocol.HEALTH_PATH) as response:
            assert response.status == 200
        rss_after, peak = memory_kib(process.pid)
    sent = SENT["requests"] - first + 100  # and 100 slow connections
    print(f"\nsidecar: {sent} hostile requests, resident {rss_before >> 10} -> {rss_after >> 10} MiB "
          f"(peak {peak >> 10} MiB)")  # fmt: skip
    assert process.poll() is None
    assert rss_after - rss_before < 64 << 10, f"resident memory grew {(rss_after - rss_before) >> 10} MiB"
