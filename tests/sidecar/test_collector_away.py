"""`rankwatch sidecar` as a real process while its collector is away for a few seconds: the queue stays
within --queue-size, the summaries it had to drop are counted and told to the collector on the first
summary that gets through, and once a collector listens on the same port again the sidecar ships what it
kept, oldest first, and exits 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import aiohttp

from rankwatch.protocol import WindowSummary
from rankwatch.sidecar.shipper import Backoff, Shipper

QUEUE_SIZE = 4
WINDOW_S = 0.2
OUTAGE_DROPS = 8  # the collector stays away until at least this many summaries were dropped


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
    """The sidecar's unlabelled gauges and counters, or None while it is not serving yet."""
    try:
        async with session.get(url) as response:
            text = await response.text()
    except aiohttp.ClientConnectionError:
        return None
    return {m[1]: float(m[2]) for m in re.finditer(r"^(rankwatch_sidecar_\w+) (\S+)$", text, re.MULTILINE)}


async def test_a_real_sidecar_keeps_a_bounded_queue_while_the_collector_is_away_and_ships_it_after(
    tmp_path, collector, free_port, token, token_file, ring_writer
):
    await collector.stop()  # nobody listens on the collector's port for a while
    collector_port = collector.port
    traces = tmp_path / "traces"
    traces.mkdir()
    writer = ring_writer(traces / f"rankwatch-n-{os.getpid()}.ring", rank=0, pid=os.getpid(), capacity=1024)
    env = {
        **os.environ,
        "RANKWATCH_TRACE_DIR": str(traces),
        "RANKWATCH_TOKEN_FILE": str(token_file),
        "RANKWATCH_JOB_NAMESPACE": "team-a",
        "RANKWATCH_JOB_NAME": "llama",
        "POD_NAME": "llama-worker-0",
        "NODE_NAME": "gpu-node-0",
        "RANKWATCH_NPROC_PER_NODE": "1",
        "RANKWATCH_SENSITIVITY_SECONDS": "60",
        "RANKWATCH_PYTHON_STACKS": "0",
    }
    log = open(tmp_path / "sidecar.log", "w+")  # noqa: SIM115 - read after the process exits
    process = subprocess.Popen(
        [sys.executable, "-m", "rankwatch", "sidecar", "--host", "127.0.0.1", "--port", str(free_port),
         "--collector-url", f"http://127.0.0.1:{collector_port}", "--queue-size", str(QUEUE_SIZE),
         "--window-seconds", str(WINDOW_S), "--poll-seconds", "0.05"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    metrics_url = f"http://127.0.0.1:{free_port}/metrics"
    calls = 0
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:

            async def train_until(condition, timeout: float) -> dict[str, float]:
                """Keep the rank calling AllReduce (and the queue in check) until the metrics satisfy ``condition``."""
                nonlocal calls
                deadline = time.monotonic() + timeout
                while True:
                    assert process.poll() is None, "the sidecar exited"
                    writer.call()
                    calls += 1
                    metrics = await scrape(session, metrics_url)
                    if metrics:
                        assert metrics["rankwatch_sidecar_queue_messages"] <= QUEUE_SIZE, metrics
                        if condition(metrics):
                            return metrics
                    assert time.monotonic() < deadline, f"timed out; last metrics {metrics}"
                    await asyncio.sleep(0.05)

            away = await train_until(lambda m: m["rankwatch_sidecar_summaries_dropped_total"] >= OUTAGE_DROPS, 30)
            assert away["rankwatch_sidecar_post_failures_total"] >= 2, away
            assert collector.summaries == []

            await collector.start(collector_port)  # the collector is back on the same port
            back = time.monotonic()
            await train_until(lambda m: len(collector.summaries) >= QUEUE_SIZE + 3, 60)
            recovered_s = time.monotonic() - back
            await train_until(lambda m: m["rankwatch_sidecar_queue_messages"] == 0, 30)
            final = await scrape(session, metrics_url)
        assert final is not None
        process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(process.wait, 20)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        writer.close()
    log.seek(0)
    output = log.read()
    assert process.returncode == 0, output
    assert "Traceback" not in output, output

    dropped = int(final["rankwatch_sidecar_summaries_dropped_total"])
    received = collector.summaries
    assert sum(s.dropped_summaries for s in received) == dropped, "every drop is told to the collector once"
    assert received[0].dropped_summaries >= OUTAGE_DROPS, "the first summary through tells of the outage"
    windows = [s.window for s in received]
    assert windows == list(range(windows[0], windows[0] + len(windows))), "what was kept, oldest first, no gaps"
    assert windows[0] == dropped + 1, "only the oldest windows were dropped, and exactly those counted"
    shipped_calls = sum(c.calls.get("AllReduce", 0) for s in received for r in s.ranks for c in r.comms)
    assert 0 < shipped_calls <= calls
    print(f"collector away: {dropped} summaries dropped (queue <= {QUEUE_SIZE}); shipped {recovered_s:.1f} s after")


def bare_summary(window: int) -> WindowSummary:
    return WindowSummary(
        schema=1, namespace="team-a", job="llama", pod="llama-worker-0", node="gpu-node-0", replica_index=0,
        expected_ranks=1, window=window, start_ns=window, end_ns=window + 1, dropped_summaries=0, ranks=[],
    )  # fmt: skip


async def test_a_summary_pushed_out_of_a_full_queue_while_it_is_being_sent_is_not_counted_as_dropped(collector, token):
    """A slow collector: the summary in flight leaves the full queue to make room, then is delivered anyway."""
    collector.delays = [0.5]
    shipper = Shipper(collector.url, "team-a", "llama", lambda: token, queue_size=1, backoff=Backoff(0.05, 0.2))
    shipper.start()
    try:
        shipper.submit_summary(bare_summary(1))
        await collector.wait_for(lambda: collector.delays == [])  # window 1 is on the wire
        shipper.submit_summary(bare_summary(2))  # the full queue makes room for it
        await collector.wait_for(lambda: len(collector.summaries) == 2)
        assert await shipper.drain(5)
    finally:
        await shipper.close()
    assert [s.window for s in collector.summaries] == [1, 2], "both delivered, in order"
    assert shipper.stats.summaries_dropped == 0, "nothing was lost"
    assert [s.dropped_summaries for s in collector.summaries] == [0, 0], "so no drop is told"
