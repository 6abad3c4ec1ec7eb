"""Why, not only who: the cause of a finding, and the evidence that decided it.

``compute | communication | host | data/storage | unknown``. Rules, in order, each stating its numbers:

- a slow link is ``communication`` (transfers between two ranks take longer than between the others);
- a culprit whose host is starved is ``host``: its process waited for a CPU (run-queue delay) far
  longer than its peers', or its node's CPUs were contended (pressure) far more than the job's other
  nodes'. These figures come from the sidecars' window summaries (``HostLoads``), so only the
  in-cluster diagnosis has them;
- a straggler whose own time between collectives is longer than its peers' is ``compute`` when
  something shows the host was not the one behind: its GPU still had earlier work queued when the host
  launched the collective (GPU-timed traces), or its process waited for a CPU no longer than its peers;
- anything else is ``unknown``, saying what is missing: a cause is never guessed. (``data/storage``
  is in the vocabulary for the evidence that will decide it, a culprit's Python stack inside a data
  loader or a checkpoint write; no rule here decides it yet.)
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from rankwatch.analysis.findings import Cause, Finding, FindingKind

HOST_MIN_DELAY_SHARE = 0.05
"""A culprit waiting for a CPU at least 50 ms per second of wall time..."""
HOST_DELAY_RATIO = 3.0
"""... and at least three times its peers' median wait is starved (a busy machine delays every rank a little)."""
PRESSURE_MIN = 0.3
"""A node whose CPUs were contended at least 30% of the time..."""
PRESSURE_MARGIN = 0.2
"""... and 20 points more than the median of the job's other nodes is a starved node."""
GPU_QUEUE_SHARE = 0.5
"""A straggler's collectives waiting behind earlier GPU work for at least half its extra time: its GPU is behind."""


@dataclass(frozen=True)
class RankHostLoad:
    """One rank's scheduling over the recent windows (from the sidecar's summaries)."""

    rank: int
    node: str
    run_delay_share: float  # seconds waited for a CPU per second of wall time
    involuntary_switches_per_s: float
    windows: int  # windows it is taken over


@dataclass(frozen=True)
class HostLoads:
    """What the job's hosts did recently: per rank, and the CPU pressure per node (share of time some
    task waited for a CPU); either may lack ranks or nodes whose sidecars could not read them."""

    ranks: dict[int, RankHostLoad]
    node_cpu_pressure: dict[str, float]


def starved(run_delay_share: float, peers_median: float) -> bool:
    """A process waiting for a CPU far longer than its peers (the rule ``host`` rests on)."""
    return run_delay_share >= HOST_MIN_DELAY_SHARE and run_delay_share >= HOST_DELAY_RATIO * peers_median


def attribute(finding: Finding, host: HostLoads | None = None) -> Finding:
    """``finding`` with its cause and the evidence that decided it."""
    cause, evidence = _decide(finding, host)
    return dataclasses.replace(finding, cause=cause, cause_evidence=evidence)


def _decide(finding: Finding, host: HostLoads | None) -> tuple[Cause, str]:
    evidence = finding.evidence
    if finding.kind is FindingKind.MISMATCH:
        return Cause.SOFTWARE, finding.cause_evidence or "ranks disagree on one collective: a code path, not a node"
    if not finding.ranks:
        return Cause.UNKNOWN, "no rank is named, so there is no host, GPU or link to attribute it to"
    if finding.kind is FindingKind.SLOW_LINK and evidence.get("from_call_times"):  # gloo: host_link.py
        return Cause.COMMUNICATION, (
            f"ranks {' and '.join(map(str, finding.ranks))} each wait longer than their peers where they receive from "
            f"the other ({evidence.get('upstream_late_ms', '?')} and {evidence.get('downstream_late_ms', '?')} ms a "
            "step) while the other is on time there: transfers between them arrive late"
        )
    if finding.kind is FindingKind.SLOW_LINK:
        return Cause.COMMUNICATION, (
            f"transfers between ranks {' and '.join(map(str, finding.ranks))} take "
            f"{evidence.get('median_transfer_ms', '?')} ms once both sides are ready, against "
            f"{evidence.get('typical_transfer_ms', '?')} ms for the other pairs"
        )
    starved = _starved_host(finding, host)
    if starved:
        return Cause.HOST, starved
    excess = evidence.get("compute_excess_ms")
    if finding.kind is FindingKind.STRAGGLER and evidence.get("own_compute") and excess and excess > 0:
        slower = f"its time between collectives is {excess:.2f} ms longer than its peers'" + (
            f" ({evidence['slowdown']:.0%} slower)" if evidence.get("slowdown") else ""
        )
        queued = evidence.get("gpu_queue_ms")
        if queued is not None and queued >= GPU_QUEUE_SHARE * excess:
            return Cause.COMPUTE, (
                f"{slower}, and its collectives waited {queued:.2f} ms on its GPU behind earlier work after the "
                "host launched them: the GPU, not the host, is behind"
            )
        calm = _calm_host(finding, host)
        if calm:
            return Cause.COMPUTE, f"{slower}, while {calm}"
        return Cause.UNKNOWN, (
            f"{slower}; without the host's scheduling figures (the in-cluster diagnosis has them) or GPU "
            "queueing, slower compute cannot be told from a starved host"
        )
    if finding.kind is FindingKind.STRAGGLER:
        return Cause.UNKNOWN, "its own time between collectives is not longer than its peers': lateness passed on"
    if host is None:
        return Cause.UNKNOWN, "no figure in the traces says why; the host's scheduling figures were not available"
    return Cause.UNKNOWN, "no figure says why: the culprit's host was not starved and no link was slow"


def _peer_median(host: HostLoads, culprits: set[int]) -> tuple[float, int] | None:
    peers = [load.run_delay_share for rank, load in host.ranks.items() if rank not in culprits]
    return (statistics.median(peers), len(peers)) if peers else None


def _starved_host(finding: Finding, host: HostLoads | None) -> str | None:
    """What shows a culprit's host starved, or None."""
    if host is None:
        return None
    culprits = set(finding.ranks)
    peers = _peer_median(host, culprits)
    if peers is not None:
        median, count = peers
        for rank in sorted(culprits):
            load = host.ranks.get(rank)
            if load is None:
                continue
            share = load.run_delay_share
            if starved(share, median):
                return (
                    f"rank {rank}'s process waited {share * 1e3:.0f} ms per second for a CPU (run-queue delay; "
                    f"{load.involuntary_switches_per_s:.0f} involuntary context switches/s) against a median "
                    f"{median * 1e3:.0f} ms/s of its {count} peers, over the last {load.windows} "
                    f"window{'s' if load.windows != 1 else ''}"
                )
    for node in sorted(set(finding.nodes)):
        pressure = host.node_cpu_pressure.get(node)
        others = [value for other, value in host.node_cpu_pressure.items() if other != node]
        if pressure is None or not others:
            continue  # one node alone: its pressure singles out no culprit
        typical = statistics.median(others)
        if pressure >= PRESSURE_MIN and pressure >= typical + PRESSURE_MARGIN:
            return (
                f"node {node}'s CPUs were contended {pressure:.0%} of the time (CPU pressure, some) against "
                f"{typical:.0%} on the job's {len(others)} other nodes"
            )
    return None


def _calm_host(finding: Finding, host: HostLoads | None) -> str | None:
    """The figures showing every culprit's host was not starved, or None when they are missing."""
    if host is None:
        return None
    culprits = set(finding.ranks)
    peers = _peer_median(host, culprits)
    loads = [host.ranks.get(rank) for rank in sorted(culprits)]
    if peers is None or any(load is None for load in loads):
        return None
    median, count = peers
    shown = ", ".join(f"rank {load.rank} waited {load.run_delay_share * 1e3:.0f} ms/s" for load in loads if load)
    return f"{shown} for a CPU, like its {count} peers ({median * 1e3:.0f} ms/s): its host is not starved"
