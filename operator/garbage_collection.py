"""The operator's garbage-collector thresholds, set for a large, long-lived state under a stream of requests.

The job states of 64,000 ranks are about a million container objects that live for hours; requests
in flight (hundreds at once, waiting for their bodies to be checked) and each detector pass hold
thousands of young objects. With Python's default thresholds (a young collection every 700
allocations) those young objects are caught alive and promoted, and every time the promoted ones
reach a quarter of the old generation a full collection walks the whole state: at 16,000 ranks
1.6 full collections per 5 s window, most of the event loop's time (bench/operator_scale.py, GC ms).
Collecting the young generation every 50,000 allocations lets request and pass garbage die by
reference counting first (the state has no reference cycles), so almost nothing is promoted.
"""

from __future__ import annotations

import gc

THRESHOLDS = (50_000, 20, 10)
"""Young collection every 50,000 net allocations; the middle every 20 young ones; the 25% rule of
CPython decides when the full one runs."""


def tune() -> None:
    gc.set_threshold(*THRESHOLDS)
