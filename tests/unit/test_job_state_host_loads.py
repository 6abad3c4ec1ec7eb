"""A job's host loads (the detector's and a diagnosis's view of the ranks' scheduling) over the windows of
the last seconds asked: every window recent, some, or none, and ranks that never sent figures."""

from __future__ import annotations

import random

import pytest

from rankwatch.operator.diagnosis.ingest.job_state import HOST_WINDOWS, JobState, StateLimits, SummaryDigest

WINDOW_S = 5.0


def digest(window: int, starved: float) -> SummaryDigest:
    """Pod 0's window ``window``: rank 0 waits ``starved`` of each second for a CPU, rank 1 sends no
    scheduling figures (another PID namespace), rank 2 a varying share."""
    start = int(window * WINDOW_S * 1e9)
    comms = (("comm", 3, window, window, 0, None, 10, 0.002),)
    ranks = (
        (0, True, 10, None, (starved * WINDOW_S, 100 * window), comms),
        (1, True, 10, None, None, comms),
        (2, True, 10, None, (0.01 * (window % 3), 7), comms),
    )
    return SummaryDigest("team-a", "llama", "llama-worker-0", "node-0", 0, window, start, start + int(WINDOW_S * 1e9),
                         0, 0.1 * (window % 4), ranks)  # fmt: skip


def by_definition(received: list[tuple[float, float, int]], now: float, max_age_s: float) -> tuple[float, float, int]:
    """(run-queue share, switches per second, windows) over the last ``HOST_WINDOWS`` windows received
    within ``max_age_s`` of ``now``: what ``host_loads`` stands for, computed from scratch."""
    kept = [entry for at, *entry in received[-HOST_WINDOWS:] if now - at <= max_age_s]
    seconds = WINDOW_S * len(kept)
    return (round(sum(d for d, _ in kept) / seconds, 6), round(sum(s for _, s in kept) / seconds, 3), len(kept))


@pytest.mark.parametrize("max_age_s", [1.0, 12.0, 22.5, 100.0])
def test_host_loads_count_the_recent_windows_of_the_ranks_that_sent_figures(max_age_s):
    state = JobState("team-a", "llama", limits=StateLimits.for_job(3, 1))
    generator = random.Random(3)
    received = []
    for window in range(1, 12):
        starved = generator.uniform(0.0, 0.5)
        now = 100.0 + WINDOW_S * window
        state.add_digest(digest(window, starved), now=now)
        received.append((now, starved * WINDOW_S, 100 * window))
        loads = state.host_loads(now + 0.5, max_age_s)
        expected = by_definition(received, now + 0.5, max_age_s)
        if expected[2] == 0:
            assert loads.ranks == {}, "no recent window: no load, not a zero one"
            continue
        load = loads.ranks[0]
        assert (load.run_delay_share, load.involuntary_switches_per_s, load.windows) == pytest.approx(expected)
        assert load.node == "node-0" and 1 not in loads.ranks, "a rank without figures has no load"
    assert state.host_loads(now + 1000.0, 30.0).ranks == {}, "figures too old count for nothing"
