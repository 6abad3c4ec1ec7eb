"""The collector on loopback (real aiohttp server and client), speaking the sidecar protocol module."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from rankwatch import protocol
from rankwatch.operator import event_loop
from rankwatch.operator.config import CollectorSettings
from rankwatch.operator.diagnosis.ingest.collector import Collector, RateLimiter, TokenUnavailable
from rankwatch.operator.diagnosis.ingest.job_state import JobStore, StateLimits, SummaryDigest
from rankwatch.operator.diagnosis.ingest.message_parser import parse_body
from rankwatch.operator.diagnosis.metrics import DiagnosisMetrics
from rankwatch.protocol import CommWindow, Quantiles, RankScheduling, RankWindow, StallReport, WindowSummary

TOKEN = "job-token-0123456789"


def summary(pod: str = "llama-worker-0", window: int = 1, job: str = "llama", wait: float = 0.001) -> WindowSummary:
    comm = CommWindow(
        comm_id="00000000000000ab", comm_rank=0, comm_size=4, first_entered=1, last_entered=10,
        first_completed=1, last_completed=10, in_flight=0, oldest_in_flight_s=None, calls={"AllReduce": 10},
        failed=0, wait=Quantiles(10, wait, wait, wait, wait), gap=None, gpu=None,
    )  # fmt: skip
    rank = RankWindow(
        global_rank=0, local_rank=0, pid=42, ring="r.ring", alive=True, records=20, torn=0, overwritten=0,
        lost_updates=0, last_call_ns=1, step_time_s=0.02, comms=[comm],
    )  # fmt: skip
    return WindowSummary(
        schema=1, namespace="team-a", job=job, pod=pod, node="gpu-node-0", replica_index=0, expected_ranks=1,
        window=window, start_ns=1_000 * window, end_ns=1_000 * (window + 1), dropped_summaries=0, ranks=[rank],
    )  # fmt: skip


def stall() -> StallReport:
    return StallReport(
        schema=1, namespace="team-a", job="llama", pod="llama-worker-0", node="gpu-node-0", replica_index=0,
        detected_ns=123, sensitivity_s=10.0, stalled_ranks=[0], summary="rank 0 waits 10 s", megatrace_dir=None,
        positions=[],
    )  # fmt: skip


class Tokens:
    def __init__(self) -> None:
        self.tokens = {("team-a", "llama"): TOKEN}
        self.reads = 0
        self.fail = False

    async def __call__(self, namespace: str, name: str, stale: bool = False) -> str | None:
        self.reads += 1
        if self.fail:
            raise TokenUnavailable("API server down")
        return self.tokens.get((namespace, name))


WORLD_SIZE = 16


def followed(namespace: str, name: str) -> StateLimits | None:
    """The jobs the operator follows: team-a/llama (16 ranks on 2 pods) and team-a/no-secret."""
    if (namespace, name) in {("team-a", "llama"), ("team-a", "no-secret")}:
        return StateLimits.for_job(WORLD_SIZE, 2)
    return None


@pytest.fixture
async def collector(operator_metrics) -> AsyncIterator[tuple[Collector, str]]:
    stalls: list[tuple[str, str]] = []
    server = Collector(
        JobStore(),
        Tokens(),
        CollectorSettings(host="127.0.0.1", port=0, rate_per_job=1000, burst_per_job=1000),
        on_stall=lambda ns, name: stalls.append((ns, name)),
        jobs=followed,
        metrics=operator_metrics.diagnosis,
    )
    server.stalls_seen = stalls  # type: ignore[attr-defined]
    await server.start()
    yield server, f"http://127.0.0.1:{server.port}"
    await server.stop()


async def post(url: str, path: str, body: Any, token: str | None = TOKEN, gzip_it: bool = True) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = protocol.bearer(token)
    if gzip_it:
        headers["Content-Encoding"] = "gzip"
    async with aiohttp.ClientSession() as session, session.post(url + path, data=body, headers=headers) as response:
        return response.status, await response.json()


SUMMARIES = protocol.summaries_path("team-a", "llama")


async def test_summary_with_the_jobs_token_is_taken_into_the_jobs_state(collector):
    server, url = collector
    status, answer = await post(url, SUMMARIES, protocol.encode(summary()))
    assert (status, answer) == (202, {"accepted": True})
    state = server.store.peek("team-a", "llama")
    assert state.summaries == 1 and state.ranks[0].pod == "llama-worker-0"
    assert state.ranks[0].comms["00000000000000ab"].last_completed == 10


def test_the_collector_on_uvloop_takes_a_summary_with_its_parsing_worker():
    """RANKWATCH_EVENT_LOOP=uvloop: the same server, its worker process and the job state on libuv's loop."""
    pytest.importorskip("uvloop")

    async def scenario() -> tuple[int, dict, int, str]:
        server = Collector(JobStore(), Tokens(), CollectorSettings(host="127.0.0.1", port=0), jobs=followed)
        await server.start()
        try:
            status, answer = await post(f"http://127.0.0.1:{server.port}", SUMMARIES, protocol.encode(summary()))
            state = server.store.peek("team-a", "llama")
            return status, answer, state.summaries, type(asyncio.get_running_loop()).__module__
        finally:
            await server.stop()

    status, answer, taken, loop = event_loop.run(scenario(), "uvloop")
    assert (status, answer, taken) == (202, {"accepted": True}, 1) and loop.startswith("uvloop")


async def test_host_figures_of_schema_2_summaries_become_the_jobs_host_loads(collector):
    """Windows of 2 s each, rank 0 waiting 0.5 s of each for a CPU: 250 ms per second."""
    server, url = collector
    for window in (1, 2):
        rank = replace(
            summary().ranks[0], scheduling=protocol.RankScheduling(cpu_s=0.8, run_delay_s=0.5, involuntary_switches=300)
        )
        message = replace(
            summary(window=window), schema=protocol.SCHEMA_VERSION, start_ns=window * 2_000_000_000,
            end_ns=(window + 1) * 2_000_000_000, ranks=[rank], cpu_pressure=0.4 + 0.2 * window,
        )  # fmt: skip
        assert (await post(url, SUMMARIES, protocol.encode(message)))[0] == 202
    state = server.store.peek("team-a", "llama")
    loads = state.host_loads(now=state.last_seen, max_age_s=30)
    load = loads.ranks[0]
    assert (load.run_delay_share, load.involuntary_switches_per_s, load.windows, load.node) == (
        0.25, 150.0, 2, "gpu-node-0"
    )  # fmt: skip
    assert loads.node_cpu_pressure == {"gpu-node-0": 0.7}
    assert state.host_loads(now=state.last_seen + 60, max_age_s=30).ranks == {}, "only recent windows count"
    later = replace(summary(window=9), start_ns=9 * 2_000_000_000, end_ns=10 * 2_000_000_000)  # not a replay
    assert (await post(url, SUMMARIES, protocol.encode(later)))[0] == 202, "schema 1 still taken"


async def test_missing_or_wrong_token_is_401_and_changes_nothing(collector):
    server, url = collector
    assert (await post(url, SUMMARIES, protocol.encode(summary()), token=None))[0] == 401
    status, answer = await post(url, SUMMARIES, protocol.encode(summary()), token="someone-elses")
    assert status == 401 and "Bearer" in answer["error"]
    assert server.store.peek("team-a", "llama") is None


async def test_unknown_job_no_secret_and_wrong_token_get_the_same_401(collector):
    """An outsider cannot tell which jobs exist: every case answers as a wrong token does."""
    _, url = collector
    answers = []
    for name in ("llama", "no-secret", "ghost"):
        status, answer = await post(url, protocol.summaries_path("team-a", name), protocol.encode(summary(job=name)),
                                    token="someone-elses")  # fmt: skip
        answers.append((status, answer["error"].replace(name, "<job>")))
    assert answers[0][0] == 401 and len(set(answers)) == 1, answers


async def test_unknown_job_names_keep_no_state_and_read_no_secret(collector):
    server, url = collector
    reads = server.tokens.reads
    for index in range(50):
        name = f"made-up-{index}"
        status, _ = await post(url, protocol.summaries_path("team-a", name), protocol.encode(summary(job=name)))
        assert status == 401
    assert server.store.jobs == {} and server.limiter._buckets == {}
    assert server.tokens.reads == reads, "no Secret is read for a job the operator does not follow"


async def test_unauthenticated_clients_cannot_drain_a_jobs_rate_limit():
    server = Collector(JobStore(), Tokens(), CollectorSettings(host="127.0.0.1", port=0, rate_per_job=0.01,
                                                               burst_per_job=2), jobs=followed)  # fmt: skip
    await server.start()
    try:
        url = f"http://127.0.0.1:{server.port}"
        for window in range(20):
            status, _ = await post(url, SUMMARIES, protocol.encode(summary(window=window)), token="guess")
            assert status == 401
        statuses = [(await post(url, SUMMARIES, protocol.encode(summary(window=w))))[0] for w in (30, 31)]
        assert statuses == [202, 202], "the job's own sidecar still has its whole burst"
    finally:
        await server.stop()


async def test_token_store_outage_is_503_so_the_sidecar_retries(collector):
    server, url = collector
    server.tokens.fail = True
    status, answer = await post(url, SUMMARIES, protocol.encode(summary()))
    assert status == 503 and "retry" in answer["error"]


async def test_redelivered_summary_is_acknowledged_once_counted_once(collector):
    server, url = collector
    body = protocol.encode(summary(window=7))
    assert (await post(url, SUMMARIES, body))[0] == 202
    status, answer = await post(url, SUMMARIES, body)
    assert (status, answer) == (208, {"duplicate": True})
    assert (await post(url, SUMMARIES, protocol.encode(summary(window=8))))[0] == 202
    assert server.store.peek("team-a", "llama").summaries == 2


async def test_oversized_bodies_are_413(collector):
    _, url = collector
    huge = gzip.compress(b"x" * (protocol.MAX_BODY_BYTES * 3), compresslevel=0)
    status, answer = await post(url, SUMMARIES, huge)
    assert status == 413 and "limit" in answer["error"]
    bomb = gzip.compress(b" " * (protocol.MAX_DECODED_BYTES + 10))  # small on the wire, huge inside
    status, answer = await post(url, SUMMARIES, bomb)
    assert status == 413 and f"more than {protocol.MAX_DECODED_BYTES} bytes" in answer["error"]

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(3):
            yield huge[: protocol.MAX_BODY_BYTES]

    status, answer = await post(url, SUMMARIES, chunks())
    assert status == 413 and "limit" in answer["error"]


async def test_bad_messages_are_refused_naming_the_field(collector):
    _, url = collector
    document = json.loads(gzip.decompress(protocol.encode(summary())))
    document["ranks"][0]["comms"][0]["wait"]["p50"] = "fast"
    status, answer = await post(url, SUMMARIES, gzip.compress(json.dumps(document).encode()))
    assert status == 422 and "ranks[0].comms[0].wait.p50" in answer["error"]
    status, answer = await post(url, SUMMARIES, b"\x1f\x8bnot gzip at all")
    assert status == 400
    other_job = protocol.encode(replace(summary(), job="other"))
    status, answer = await post(url, SUMMARIES, other_job)
    assert status == 422 and "team-a/other" in answer["error"]


async def test_stall_report_wakes_the_detector(collector):
    server, url = collector
    status, _ = await post(url, protocol.stalls_path("team-a", "llama"), protocol.encode(stall()))
    assert status == 202
    assert server.stalls_seen == [("team-a", "llama")]
    assert server.store.peek("team-a", "llama").stalls[0][1].stalled_ranks == [0]


async def test_a_job_over_its_rate_gets_429_with_retry_after():
    settings = CollectorSettings(host="127.0.0.1", port=0, rate_per_job=1, burst_per_job=2)
    server = Collector(JobStore(), Tokens(), settings, jobs=followed)
    await server.start()
    try:
        url = f"http://127.0.0.1:{server.port}"
        statuses = [(await post(url, SUMMARIES, protocol.encode(summary(window=w))))[0] for w in range(4)]
        assert statuses[:2] == [202, 202] and statuses[2:] == [429, 429]
    finally:
        await server.stop()


def test_rate_limiter_refills_with_time():
    now = [0.0]
    limiter = RateLimiter(rate=2, burst=1, clock=lambda: now[0])
    assert limiter.take(("a", "b")) == 0
    assert limiter.take(("a", "b")) == pytest.approx(0.5)
    assert limiter.take(("c", "d")) == 0, "jobs have separate buckets"
    now[0] = 0.5
    assert limiter.take(("a", "b")) == 0


async def test_metrics_endpoint_counts_messages_by_result(collector):
    _, url = collector
    await post(url, SUMMARIES, protocol.encode(summary(window=3)), token="bad")
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    assert 'rankwatch_collector_messages_total{kind="summary",result="unauthorized"}' in text
    assert "rankwatch_detector_duration_seconds_count" in text, "the monitor's detector time is served too"


async def test_with_metrics_on_their_own_port_the_collector_port_names_no_job(operator_metrics):
    """Sidecars of every team reach the collector's port; /metrics (every job's name, namespace and
    health) is only on the metrics port, which the chart's NetworkPolicy opens to Prometheus alone."""
    from rankwatch.operator.metrics_server import MetricsServer

    settings = CollectorSettings(host="127.0.0.1", port=0, serves_metrics=False)
    server = Collector(JobStore(), Tokens(), settings, jobs=followed, metrics=operator_metrics.diagnosis)
    scrape = MetricsServer("127.0.0.1", 0)
    await server.start()
    await scrape.start()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{server.port}/metrics") as response:
                assert response.status == 404
            async with session.get(f"http://127.0.0.1:{scrape.port}/metrics") as response:
                assert response.status == 200 and "rankwatch_collector_messages_total" in await response.text()
    finally:
        await scrape.stop()
        await server.stop()


async def test_nan_and_infinite_numbers_are_refused_with_422(collector):
    server, url = collector
    encoded = json.dumps(asdict(summary()))
    for bad in ("NaN", "Infinity", "-Infinity", "1e400"):
        body = encoded.replace('"p50": 0.001', f'"p50": {bad}', 1)
        assert body != encoded
        status, answer = await post(url, SUMMARIES, gzip.compress(body.encode()))
        assert status == 422 and bad.lstrip("-")[:3] in answer["error"], (bad, answer)
    assert server.store.peek("team-a", "llama") is None


async def test_replayed_older_window_is_409_and_not_taken(collector):
    server, url = collector
    assert (await post(url, SUMMARIES, protocol.encode(summary(window=8))))[0] == 202
    assert (await post(url, SUMMARIES, protocol.encode(summary(window=8))))[0] == 208, "a redelivery stays 208"
    status, answer = await post(url, SUMMARIES, protocol.encode(summary(window=5)))
    assert status == 409 and "replayed" in answer["error"]
    assert server.store.peek("team-a", "llama").summaries == 1


async def test_rank_outside_the_world_size_is_422_and_allocates_nothing(collector):
    server, url = collector
    message = summary()
    huge = replace(message, ranks=[replace(message.ranks[0], global_rank=10**15)])
    status, answer = await post(url, SUMMARIES, protocol.encode(huge))
    assert status == 422 and f"world size {WORLD_SIZE}" in answer["error"]
    assert server.store.peek("team-a", "llama") is None


async def test_bodies_in_flight_share_one_byte_budget():
    """A body still arriving holds its bytes (as sent: gzip'd bodies are inflated later, in the parsing
    worker): another that would pass the budget is 503 (retry), and is taken once the first is done."""
    settings = CollectorSettings(host="127.0.0.1", port=0, inflight_body_bytes=1 << 20)
    server = Collector(JobStore(), Tokens(), settings, jobs=followed)
    await server.start()
    url = f"http://127.0.0.1:{server.port}"
    release = asyncio.Event()
    first = json.dumps(asdict(summary(window=1))).encode()
    padding = b" " * (900 << 10)  # JSON allows whitespace: a valid document of 900 KiB

    async def slow_body() -> AsyncIterator[bytes]:
        yield padding
        await release.wait()
        yield first

    try:
        async with aiohttp.ClientSession() as session:
            headers = {"Authorization": protocol.bearer(TOKEN), "Content-Type": "application/json"}
            slow = asyncio.create_task(session.post(url + SUMMARIES, data=slow_body(), headers=headers))
            for _ in range(100):
                await asyncio.sleep(0.02)
                if server.bodies.held >= len(padding):
                    break
            assert server.bodies.held >= len(padding)
            padded = json.dumps(asdict(summary(window=2))).encode() + b" " * (300 << 10)
            other = gzip.compress(padded, compresslevel=0)  # 300 KiB as sent
            status, answer = await post(url, SUMMARIES, other)
            assert status == 503 and "busy" in answer["error"]
            release.set()
            response = await slow
            assert response.status == 202
            assert server.bodies.held == 0
            assert (await post(url, SUMMARIES, other))[0] == 202
    finally:
        await server.stop()


async def test_a_bug_answers_a_short_json_500_without_a_traceback():
    def broken(namespace: str, name: str) -> StateLimits | None:
        raise RuntimeError("secret internals")

    server = Collector(JobStore(), Tokens(), CollectorSettings(host="127.0.0.1", port=0), jobs=broken)
    await server.start()
    try:
        url = f"http://127.0.0.1:{server.port}"
        headers = {"Authorization": protocol.bearer(TOKEN)}
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + SUMMARIES, data=protocol.encode(summary()), headers=headers) as response,
        ):
            text = await response.text()
        assert response.status == 500 and "Traceback" not in text and "secret internals" not in text
        assert json.loads(text)["error"].startswith("internal error")
    finally:
        await server.stop()


async def test_concurrent_summaries_are_checked_in_worker_processes_in_batches_and_all_applied():
    """Many bodies at once go to the parsing workers in batches: each good one is taken into the job's
    state, a bad one among them is refused on its own, naming its field."""
    settings = CollectorSettings(host="127.0.0.1", port=0, parse_workers=2, rate_per_job=1000, burst_per_job=1000)
    server = Collector(JobStore(), Tokens(), settings, jobs=followed)
    await server.start()
    url = f"http://127.0.0.1:{server.port}"
    try:
        # One start time for all: bodies sent at once arrive in any order, and an earlier start after a later
        # one would be refused as replayed.
        windows = [replace(summary(pod=f"llama-worker-{i % 2}", window=i + 1), start_ns=1000) for i in range(120)]
        bodies = [protocol.encode(window) for window in windows]
        document = json.loads(gzip.decompress(bodies[60]))
        document["ranks"][0]["alive"] = "yes"
        bodies[60] = gzip.compress(json.dumps(document).encode())
        answers = await asyncio.gather(*(post(url, SUMMARIES, body) for body in bodies))
        statuses = [status for status, _ in answers]
        assert statuses.count(202) == 119 and statuses[60] == 422
        assert "ranks[0].alive" in answers[60][1]["error"]
        state = server.store.peek("team-a", "llama")
        assert state.summaries == 119 and set(state.pods) == {"llama-worker-0", "llama-worker-1"}
        assert state.ranks[0].comms["00000000000000ab"].last_completed == 10
    finally:
        await server.stop()


async def test_a_parsing_worker_killed_answers_503_and_new_workers_take_over():
    """A worker that dies (OOM-killed) loses only the bodies it held: they are answered 503 (the sidecar
    retries), and the next bodies are parsed by new workers."""
    settings = CollectorSettings(host="127.0.0.1", port=0, parse_workers=1)
    server = Collector(JobStore(), Tokens(), settings, jobs=followed)
    await server.start()
    url = f"http://127.0.0.1:{server.port}"
    try:
        assert (await post(url, SUMMARIES, protocol.encode(summary(window=1))))[0] == 202
        (worker,) = server.parser.processes()  # the real worker process
        worker.kill()
        worker.join(10)
        status, answer = await post(url, SUMMARIES, protocol.encode(summary(window=2)))
        assert status in (202, 503), answer  # 503 when the dead worker was still handed the batch
        if status == 503:
            assert "retry" in answer["error"]
        status, answer = await post(url, SUMMARIES, protocol.encode(summary(window=3)))
        assert status == 202, answer
        assert server.store.peek("team-a", "llama").ranks[0].comms["00000000000000ab"].last_completed == 10
    finally:
        await server.stop()


async def test_without_parsing_workers_the_loop_checks_the_bodies():
    settings = CollectorSettings(host="127.0.0.1", port=0, parse_workers=0)
    server = Collector(JobStore(), Tokens(), settings, jobs=followed)
    await server.start()
    url = f"http://127.0.0.1:{server.port}"
    try:
        assert (await post(url, SUMMARIES, protocol.encode(summary())))[0] == 202
        status, answer = await post(url, SUMMARIES, gzip.compress(b'{"schema": 2, "window": NaN}'))
        assert status == 422 and "NaN" in answer["error"]
        bomb = gzip.compress(b" " * (protocol.MAX_DECODED_BYTES + 10))
        assert (await post(url, SUMMARIES, bomb))[0] == 413
        assert server.parser.processes() == [], "no process started"
    finally:
        await server.stop()


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except OSError:
                continue
    return found


def test_parsing_workers_end_with_a_killed_collector_process():
    """An operator killed outright (SIGKILL, OOM) leaves no parsing worker behind waiting for work."""
    script = Path(__file__).parent.parent / "hostile" / "collector_process.py"
    env = {**os.environ, "HOSTILE_TOKEN": TOKEN}
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env)
    try:
        assert process.stdout.readline().startswith(b"port "), "the collector started (its workers answered)"
        workers = [pid for pid in _children(process.pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert workers, "the collector runs a parsing worker"
    finally:
        process.kill()
        process.wait(10)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    assert not alive, f"parsing workers {alive} outlived the collector"


def test_a_body_checked_in_a_worker_digests_as_its_summary():
    """The parsing worker digests the checked document without building the summary's dataclasses: the
    digest is the summary's own, GPU waits, host figures and a communicator without collectives too."""
    base = summary()
    gpu = replace(base.ranks[0].comms[0], gpu=Quantiles(10, 0.5, 0.6, 0.7, 0.8))
    sends = replace(base.ranks[0].comms[0], comm_id="00000000000000cd", calls={"Send": 3}, wait=None)
    rank = replace(base.ranks[0], comms=[gpu, sends], scheduling=RankScheduling(1.0, 0.25, 7))
    message = replace(base, ranks=[rank, replace(rank, global_rank=1, scheduling=None)], cpu_pressure=0.3)
    digest = parse_body(protocol.encode(message), protocol.CONTENT_ENCODING, "summary")
    assert digest == SummaryDigest.of(message)
    assert digest.ranks[0][5][0][7] == 0.5 and digest.ranks[0][5][1][6:] == (0, None)


async def test_every_answer_is_counted_by_kind_and_result():
    """Each message is counted once under the result its answer means (the counters are looked up once
    per result and reused): taken, redelivered, refused, and a bug's 500."""
    metrics = DiagnosisMetrics(CollectorRegistry())
    broken = False

    def jobs(namespace: str, name: str) -> StateLimits | None:
        if broken:
            raise RuntimeError("a bug")
        return followed(namespace, name)

    server = Collector(JobStore(), Tokens(), CollectorSettings(host="127.0.0.1", port=0), jobs=jobs, metrics=metrics)
    await server.start()
    try:
        url = f"http://127.0.0.1:{server.port}"
        statuses = [
            (await post(url, SUMMARIES, protocol.encode(summary(window=2))))[0],
            (await post(url, SUMMARIES, protocol.encode(summary(window=2))))[0],
            (await post(url, SUMMARIES, protocol.encode(summary(window=3))))[0],
            (await post(url, SUMMARIES, protocol.encode(replace(summary(window=1), start_ns=1))))[0],
            (await post(url, SUMMARIES, protocol.encode(summary(window=4)), token="guess"))[0],
            (await post(url, SUMMARIES, b"{}", gzip_it=False))[0],
            (await post(url, protocol.stalls_path("team-a", "llama"), protocol.encode(stall())))[0],
        ]
        broken = True
        statuses.append((await post(url, SUMMARIES, protocol.encode(summary(window=5))))[0])
    finally:
        await server.stop()
    assert statuses == [202, 208, 202, 409, 401, 422, 202, 500]
    counted = {
        (sample.labels["kind"], sample.labels["result"]): sample.value
        for sample in metrics.collector_messages.collect()[0].samples
        if sample.name.endswith("_total")
    }
    assert counted == {
        ("summary", "accepted"): 2, ("summary", "duplicate"): 1, ("summary", "replayed"): 1,
        ("summary", "unauthorized"): 1, ("summary", "invalid"): 1, ("stall", "accepted"): 1, ("summary", "error"): 1,
    }  # fmt: skip
    assert metrics.collector_rank_windows._value.get() == 2, "one rank window per summary taken"
