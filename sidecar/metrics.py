"""Prometheus metrics of the sidecar, collected at scrape time from numpy counters.

Wait times are bucketed per poll with one ``searchsorted`` + ``add.at`` (observing records one by one
would cost a Python call per NCCL call). Labels: ``rank`` (the pod's global ranks, at most
``MAX_RANK_LABELS``, the rest as "other") and ``op`` (the ten NCCL operations): bounded cardinality.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from rankwatch.analysis.ring import Op
from rankwatch.protocol import OP_NAMES
from rankwatch.sidecar.progress import Entered, Finished
from rankwatch.sidecar.ring_tail import PolledRing

WAIT_BUCKETS = np.array(
    [1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0]
)
OPS = int(Op.RECV) + 1  # op codes 1..10 (0 unused)
MAX_RANK_LABELS = 64


@dataclass
class RankCounters:
    calls: np.ndarray = field(default_factory=lambda: np.zeros(OPS, np.int64))
    wait_buckets: np.ndarray = field(default_factory=lambda: np.zeros((OPS, len(WAIT_BUCKETS) + 1), np.int64))
    wait_sum: np.ndarray = field(default_factory=lambda: np.zeros(OPS, np.float64))
    records: int = 0
    torn: int = 0
    overwritten: int = 0


@dataclass(frozen=True)
class LiveRank:
    """Gauges of one followed ring, computed at scrape time."""

    rank: int
    stall_seconds: float  # oldest call in flight, else silence since the last call or return
    lag_records: int


@dataclass(frozen=True)
class LiveState:
    ranks: list[LiveRank]
    rings: int
    unreadable_rings: int
    queued: int
    summaries_sent: int
    summaries_dropped: int
    stalls_sent: int
    stall_reports: int
    post_failures: int
    rejected: int


class SidecarMetrics(Collector):
    def __init__(self, live: Callable[[], LiveState]) -> None:
        self._live = live
        self._ranks: dict[str, RankCounters] = {}

    def _label(self, rank: int) -> str:
        label = str(rank) if rank >= 0 else "unknown"
        if label not in self._ranks and len(self._ranks) >= MAX_RANK_LABELS:
            return "other"
        return label

    def observe(self, ring: PolledRing, entered: Entered, finished: Finished) -> None:
        counters = self._ranks.setdefault(self._label(ring.tail.header.global_rank), RankCounters())
        counters.records += len(ring.batch.entered)
        counters.torn += ring.batch.torn
        counters.overwritten += ring.batch.overwritten
        counters.calls += np.bincount(entered.op, minlength=OPS)[:OPS]
        returned = finished.wait >= 0
        if returned.any():
            ops, seconds = finished.op[returned], finished.wait[returned] / 1e9
            buckets = np.searchsorted(WAIT_BUCKETS, seconds, side="left")
            width = len(WAIT_BUCKETS) + 1
            counters.wait_buckets += np.bincount(ops * width + buckets, minlength=OPS * width).reshape(OPS, width)
            counters.wait_sum += np.bincount(ops, weights=seconds, minlength=OPS)

    def collect(self) -> Iterable[Metric]:
        calls = CounterMetricFamily("rankwatch_collective_calls", "NCCL calls entered", labels=["rank", "op"])
        wait = HistogramMetricFamily(
            "rankwatch_collective_wait_seconds", "host time inside NCCL calls", labels=["rank", "op"]
        )
        records = CounterMetricFamily("rankwatch_sidecar_records_read", "ring records read", labels=["rank"])
        torn = CounterMetricFamily("rankwatch_sidecar_torn_records", "ring records skipped as torn", labels=["rank"])
        overwritten = CounterMetricFamily(
            "rankwatch_sidecar_overwritten_records", "ring records wrapped over before read", labels=["rank"]
        )
        for rank, counters in sorted(self._ranks.items()):
            records.add_metric([rank], counters.records)
            torn.add_metric([rank], counters.torn)
            overwritten.add_metric([rank], counters.overwritten)
            for op in np.flatnonzero(counters.calls).tolist():
                name = OP_NAMES[op]
                calls.add_metric([rank, name], int(counters.calls[op]))
                cumulative = np.cumsum(counters.wait_buckets[op]).tolist()
                buckets = [
                    (f"{bound:g}", count) for bound, count in zip(WAIT_BUCKETS.tolist(), cumulative, strict=False)
                ]
                buckets.append(("+Inf", cumulative[-1]))
                wait.add_metric([rank, name], buckets, float(counters.wait_sum[op]))
        yield from (calls, wait, records, torn, overwritten)

        live = self._live()
        stall = GaugeMetricFamily(
            "rankwatch_sidecar_stall_seconds",
            "age of the rank's oldest call in flight, else its silence since its last call",
            labels=["rank"],
        )
        lag = GaugeMetricFamily("rankwatch_sidecar_ring_lag_records", "records written, not yet read", labels=["rank"])
        for rank in live.ranks:
            stall.add_metric([self._label(rank.rank)], rank.stall_seconds)
            lag.add_metric([self._label(rank.rank)], rank.lag_records)
        yield stall
        yield lag
        yield GaugeMetricFamily("rankwatch_sidecar_rings", "ring files followed", value=live.rings)
        yield GaugeMetricFamily("rankwatch_sidecar_unreadable_rings", "ring files skipped", value=live.unreadable_rings)
        yield GaugeMetricFamily("rankwatch_sidecar_queue_messages", "messages waiting to be sent", value=live.queued)
        yield CounterMetricFamily("rankwatch_sidecar_summaries_sent", "summaries accepted", value=live.summaries_sent)
        yield CounterMetricFamily(
            "rankwatch_sidecar_summaries_dropped", "summaries dropped by the full queue", value=live.summaries_dropped
        )
        yield CounterMetricFamily("rankwatch_sidecar_stall_reports", "stalls detected", value=live.stall_reports)
        yield CounterMetricFamily(
            "rankwatch_sidecar_stall_reports_sent", "stall reports accepted", value=live.stalls_sent
        )
        yield CounterMetricFamily("rankwatch_sidecar_post_failures", "POSTs to be retried", value=live.post_failures)
        yield CounterMetricFamily(
            "rankwatch_sidecar_messages_rejected", "messages the collector refused for good", value=live.rejected
        )
