"""The collector down, failing, refusing the token or slow: the sidecar retries, keeps its queue bounded,
keeps reading, and what arrives once the collector is back is right."""

from __future__ import annotations

import asyncio
import os

from rankwatch.protocol import WindowSummary


async def run_until(sidecar, condition, timeout: float = 20.0) -> None:
    """Run the sidecar's loop until ``condition()``, then stop it (flushing) and check it did not crash."""
    stop = asyncio.Event()
    running = asyncio.create_task(sidecar.run(stop))
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert not running.done(), running.exception()
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)
    stop.set()
    await running


async def test_500s_and_a_refused_token_are_retried_until_the_summaries_arrive(
    trace_dir, collector, make_sidecar, token_file, token, ring_calls, summarised_calls
):
    token_file.write_text("an-old-token")
    collector.script = [500, 503, 500]  # then 401s while the token is stale
    sidecar = await make_sidecar(trace_dir, collector.url, window_s=0.1, poll_s=0.05)

    def rotated() -> bool:
        if collector.answers.count(401) >= 2 and token_file.read_text() != token:
            token_file.write_text(token)  # the Secret mount updated in place
        return len(collector.summaries) >= 5

    await run_until(sidecar, rotated)
    assert collector.answers[:3] == [500, 503, 500] and collector.answers.count(401) >= 2
    stats = sidecar.shipper.stats
    assert stats.failures >= 5 and stats.summaries_dropped == 0 and stats.rejected == 0
    windows = [s.window for s in collector.summaries]
    assert windows == list(range(1, len(windows) + 1)), "nothing lost, in order, once each"
    assert summarised_calls(collector.summaries) == ring_calls(trace_dir)


async def test_a_collector_that_is_down_fills_a_bounded_queue_and_hears_of_the_drops(
    tmp_path, collector, make_sidecar, free_port, ring_writer
):
    traces = tmp_path / "traces"
    traces.mkdir()
    writer = ring_writer(traces / f"rankwatch-n-{os.getpid()}.ring", rank=0, pid=os.getpid(), capacity=256)
    sidecar = await make_sidecar(
        traces, f"http://127.0.0.1:{free_port}", window_s=0.05, poll_s=0.02, queue_size=3, sensitivity_s=60
    )
    stop = asyncio.Event()
    running = asyncio.create_task(sidecar.run(stop))
    for _ in range(30):  # calls while nobody listens
        writer.call()
        await asyncio.sleep(0.03)
    shipper = sidecar.shipper
    assert shipper.queued() <= 3, "the queue stays bounded"
    assert shipper.stats.summaries_dropped >= 10 and shipper.stats.failures >= 3
    assert sidecar.summaries >= 13, "the reader kept its pace"

    server = type(collector)()
    await server.start(free_port)  # the collector is back
    try:
        while shipper.queued() or not server.summaries:
            assert not running.done(), running.exception()
            await asyncio.sleep(0.05)
        dropped = shipper.stats.summaries_dropped
        assert sum(s.dropped_summaries for s in server.summaries) == dropped, "every drop reported once"
        assert server.summaries[0].dropped_summaries >= 10, "the first summary accepted tells of the outage"

        seen = len(server.summaries)
        for _ in range(7):  # calls after recovery are counted exactly
            writer.call()
        while sum(c.calls.get("AllReduce", 0) for s in server.summaries[seen:] for r in s.ranks for c in r.comms) < 7:
            assert not running.done(), running.exception()
            await asyncio.sleep(0.05)
        stop.set()
        await running
        after = [c for s in server.summaries[seen:] for r in s.ranks for c in r.comms]
        assert sum(c.calls.get("AllReduce", 0) for c in after) == 7
        assert min(c.first_entered for c in after if c.first_entered) == 31
        assert max(c.last_entered for c in after if c.last_entered) == 37
        assert all(isinstance(s, WindowSummary) for s in server.summaries)
    finally:
        await server.stop()
        writer.close()


async def test_a_slow_collector_times_out_and_the_summary_is_sent_again(
    trace_dir, collector, make_sidecar, ring_calls, summarised_calls
):
    collector.delays = [1.5]  # longer than the sidecar's POST timeout
    sidecar = await make_sidecar(trace_dir, collector.url, window_s=0.1, poll_s=0.05, post_timeout_s=0.3)
    await run_until(sidecar, lambda: len({s.window for s in collector.summaries}) >= 4)
    assert sidecar.shipper.stats.failures >= 1
    windows = sorted({s.window for s in collector.summaries})
    assert windows == list(range(1, len(windows) + 1)), "at least once: duplicates possible, gaps not"
    assert summarised_calls(collector.summaries) == ring_calls(trace_dir)
