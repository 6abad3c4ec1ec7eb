"""Fail-slow against a busy machine's bursts of slow steps, on step-time series measured on one.

Each series is the step times (ms) `rankwatch analyze` read from a real `rankwatch simulate` run on this
project's shared 2-core machine: test_detect_simulated's fail-slow run (8 ranks TP 4, 5 ms of compute,
rank 2 computing twice as long from step 20 on), which failed there about 1 run in 5 at load 5-14.

LOADED_RUN_MS, at load 8.5: other jobs held it back from step 1 to 5 and
again from 11 to 19, so the steps of its first third are 41 ms or around 60 ms: their MAD (13 ms as a
sigma) put the bar for a slow step at 136 ms, above the slowed steps (about 96 ms), and the rise went
unreported. From one step to the next they move by 5.6 ms (the bursts' edges aside): the bar is 92 ms.
"""

from __future__ import annotations

import numpy as np

from rankwatch.analysis.fail_slow import step_noise, step_time_rise

LOADED_RUN_MS = [
    56.4, 59.7, 66.9, 58.1, 61.6, 41.1, 41.0, 40.9, 41.0, 41.1, 61.0, 90.6, 65.7, 64.5, 68.5, 62.3, 69.2,
    67.3, 62.9, 105.1, 96.8, 95.1, 99.8, 99.9, 95.5, 99.7, 96.9, 95.9, 99.1, 95.8, 97.5, 94.7, 95.9, 91.2,
    87.9, 92.4, 87.0, 88.6, 85.5,
]  # fmt: skip
BURST_BEFORE_MS = [
    41.3, 41.3, 42.5, 41.1, 111.6, 137.2, 164.9, 42.8, 41.1, 41.1, 41.1, 41.2, 41.1, 41.5, 41.1, 41.0, 41.2,
    41.1, 41.7, 81.9, 82.1, 81.7, 84.4, 82.2, 82.0, 82.2, 81.8, 81.7, 81.8, 81.9, 81.7, 81.9, 81.8, 82.2, 83.2,
    82.0, 81.6, 82.2, 83.1,
]  # fmt: skip
"""At load 7.6: a burst of three slow steps (5 to 7) long before the real onset; the median of every step
from step 5 on is the doubled one, so the burst passed for the onset."""
ONSET_STEP = 20  # the series' index 19: the interval that begins with rank 2's first slow step


def test_a_rise_is_found_when_load_bursts_filled_part_of_its_baseline():
    durations = np.array(LOADED_RUN_MS) * 1e6
    found = step_time_rise(durations)
    assert found is not None, "the doubled compute of rank 2 went unreported"
    onset, rise, baseline, after, _ = found
    assert onset + 1 == ONSET_STEP
    assert 0.6 <= rise <= 1.4, rise  # twice the compute, less the share a busy machine adds to both sides
    assert 55e6 <= baseline <= 65e6 and 85e6 <= after <= 100e6


def test_a_burst_long_before_the_onset_is_not_taken_for_it():
    found = step_time_rise(np.array(BURST_BEFORE_MS) * 1e6)
    assert found is not None
    onset, rise, *_ = found
    assert onset + 1 == ONSET_STEP  # the job ran at 41 ms again from step 8 to 19
    assert 0.9 <= rise <= 1.1


def test_a_lasting_rise_with_single_quick_steps_keeps_its_onset():
    # steps of the slowed job that came out quick here and there (nearer the old pace) refute no onset:
    # only steps back at the old pace several in a row say the job could still keep it
    durations = np.array(BURST_BEFORE_MS) * 1e6
    durations[[24, 31]] = 45e6
    onset, *_ = step_time_rise(durations)
    assert onset + 1 == ONSET_STEP


def test_the_same_bursts_without_the_slowdown_are_no_rise():
    # the steps before the onset alone: two load bursts and the quiet steps between them
    assert step_time_rise(np.array(LOADED_RUN_MS[: ONSET_STEP - 1]) * 1e6) is None


def test_step_noise_is_the_quiet_steps_spread_whichever_shape_the_load_takes():
    quiet = np.array([41.0, 41.2, 40.9, 41.1, 41.0, 41.3, 40.8, 41.1, 41.0, 41.2, 40.9, 41.1]) * 1e6
    burst = quiet.copy()
    burst[3:9] += 25e6  # half the steps, in a row, held back by another job
    single = quiet.copy()
    single[[1, 4, 7, 10]] += 25e6  # four steps held back one at a time
    for loaded in (burst, single):
        assert step_noise(loaded) <= 3 * step_noise(quiet) + 1e5
    assert step_noise(np.array([5e6])) == 0.0
