"""The local stall watch: a rank whose oldest call in flight, or whose silence while its process lives,
exceeds the job's sensitivity is stalled. Reported once per episode (again only after it moved),
with every local rank's position; the recent records are written as Megatrace logs alongside.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rankwatch.protocol import SCHEMA_VERSION, RankPosition, StallReport
from rankwatch.sidecar.progress import RankProgress
from rankwatch.sidecar.summary import PodIdentity

DEFAULT_SENSITIVITY_S = 300.0
MEGATRACE_CALLS = 9_999  # per rank, as Megatrace's own ring keeps
MEGATRACE_SUBDIR = "megatrace"


@dataclass(frozen=True)
class WatchedRank:
    progress: RankProgress
    alive: bool


def sensitivity_s(progress: RankProgress, configured: float | None) -> float:
    """The sidecar's setting, else the one the trainer wrote into its ring, else the default."""
    if configured:
        return configured
    if progress.tail.header.sensitivity_ms > 0:
        return progress.tail.header.sensitivity_ms / 1000
    return DEFAULT_SENSITIVITY_S


def stall_kind(rank: WatchedRank, now_ns: int, sensitivity: float) -> str | None:
    age = rank.progress.oldest_in_flight_age_s(now_ns)
    if age is not None:
        return "in_flight" if age > sensitivity else None
    if rank.alive and rank.progress.silent_s(now_ns) > sensitivity:
        return "silent"
    return None


def describe(positions: list[RankPosition]) -> str:
    """One line: who is stalled, and how."""
    parts = []
    for position in positions:
        if position.stall == "in_flight":
            comm = max(
                (c for c in position.comms if c.in_flight), key=lambda c: c.oldest_in_flight_s or 0.0, default=None
            )
            if comm is not None:
                parts.append(
                    f"rank {position.global_rank} waits {comm.oldest_in_flight_s:.1f} s in {comm.oldest_in_flight_op} "
                    f"seq {comm.oldest_in_flight_seq} of communicator {comm.comm_id}"
                )
        elif position.stall == "silent":
            parts.append(f"rank {position.global_rank} made no NCCL call for {position.silent_s:.1f} s")
    return "; ".join(parts)


class StallWatch:
    def __init__(self, identity: PodIdentity, trace_dir: Path, configured_sensitivity: float | None) -> None:
        self.identity = identity
        self.configured = configured_sensitivity
        self.megatrace_dir = trace_dir / MEGATRACE_SUBDIR
        self.save_count = 0
        self._stalled: dict[str, str] = {}  # ring name -> stall kind at the last check

    def check(self, ranks: list[WatchedRank], now_ns: int) -> StallReport | None:
        """A report when a rank newly stalls (or changes how it is stalled); None otherwise."""
        kinds = {
            rank.progress.tail.name: stall_kind(rank, now_ns, sensitivity_s(rank.progress, self.configured))
            for rank in ranks
        }
        stalled = {name: kind for name, kind in kinds.items() if kind}
        fresh = {name for name, kind in stalled.items() if self._stalled.get(name) != kind}
        self._stalled = stalled
        if not fresh:
            return None
        positions = sorted(
            (r.progress.position(now_ns, r.alive, kinds[r.progress.tail.name]) for r in ranks),
            key=lambda p: (p.global_rank, p.ring),
        )
        self.save_count += 1
        return StallReport(
            schema=SCHEMA_VERSION,
            namespace=self.identity.namespace,
            job=self.identity.job,
            pod=self.identity.pod,
            node=self.identity.node,
            replica_index=self.identity.replica_index,
            detected_ns=now_ns,
            sensitivity_s=min(sensitivity_s(r.progress, self.configured) for r in ranks),
            stalled_ranks=sorted({p.global_rank for p in positions if p.stall}),
            summary=describe(positions),
            megatrace_dir=str(self.megatrace_dir),
            positions=positions,
        )

    def stalled(self) -> dict[str, str]:
        return dict(self._stalled)


def write_megatrace(rings: list[Path], directory: Path, save_count: int, calls: int = MEGATRACE_CALLS) -> list[Path]:
    """Append the last ``calls`` calls of each rank as dump ``save_count`` of Megatrace logs
    (``rank_<R>.log``; ``rankwatch analyze --log-path`` and Megatrace's own tools read them)."""
    from rankwatch.analysis.megatrace import write_logs
    from rankwatch.analysis.ring_loader import load_rings

    trace = load_rings(rings)
    ranks = trace.calls["rank"]  # sorted by rank, then call time
    if len(ranks):
        ends = np.searchsorted(ranks, ranks, side="right")
        trace.calls = trace.calls[ends - np.arange(len(ranks)) <= calls]
    return write_logs(trace, directory, save_count=save_count)
