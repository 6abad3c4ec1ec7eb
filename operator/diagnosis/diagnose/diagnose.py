"""Diagnosis on suspicion: pull the raw records from the sidecars that matter, run
``rankwatch.analysis`` on them in a worker process (``worker.py``), and say what is wrong in a
``Diagnosis``.

Which sidecars. A small job (up to :data:`EVERY_POD_UP_TO` pods): every pod, the most evidence for
the least thought. A larger one: the pods the summaries point at, at most :data:`MAX_PODS`:
- straggler: the suspects and their tensor-parallel peers (the comparison the analysis needs; with
  TP 1, the members of their communicators: an instance is compared only when all its members are in);
- hang: the ranks that fell behind on a communicator (never entered the sequence number its other
  members wait in), the pods that reported a stall, and a few members waiting in each such
  communicator (the analysis follows their waits to the culprit); when every member entered (stuck
  inside a collective) the members of the communicators whose calls are oldest;
- slowdown: a spread of pods over the job (the step time is the median over ranks) plus the pods of
  the ranks with the longest step times.
Records per ring come from a byte budget derived from the worker's memory budget, so a bigger job
gets fewer records per ring, never more memory.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rankwatch.analysis.cause import attribute
from rankwatch.analysis.findings import AnalysisReport
from rankwatch.analysis.topology import Layout
from rankwatch.model.evidence import HOST_STARVED, NODE_ALERTS, SOURCE, node_alert_lines
from rankwatch.model.finding import Cause, Finding, FindingKind
from rankwatch.operator.config import NodeAlertSources
from rankwatch.operator.diagnosis.diagnose import worker
from rankwatch.operator.diagnosis.diagnose.differential_profile import with_differential_profile
from rankwatch.operator.diagnosis.diagnose.node_alerts import firing_on
from rankwatch.operator.diagnosis.diagnose.python_frames import latest_stacks, with_python_stacks
from rankwatch.operator.diagnosis.ingest.job_state import JobState
from rankwatch.operator.sidecar_client import CHUNK_BYTES, SidecarPod, fetch_dumps
from rankwatch.timestamps import rfc3339_now as _now

log = logging.getLogger(__name__)

RECORD_BYTES = 128
DUMP_SHARE_OF_WORKER_MEMORY = 0.25
"""Dump bytes per byte of worker memory. The worker's address space is about 110 MiB before any dump
and grows by 1.05-1.25x the dump's size (mapped rings, then the records in columns, sorted and grouped;
bench/diagnosis_memory.py): a quarter leaves room for an analysis that needs more than a straggler's."""
MAX_RECORDS_PER_RING = 20_000
MIN_RECORDS_PER_RING = 500
HISTORY_SECONDS = 30.0
"""How much recent history a ring's dump should cover, when the summaries tell its call rate."""
EVERY_POD_UP_TO = 16
MAX_PODS = 64
WAITERS_PER_COMMUNICATOR = 2
SPREAD_PODS = 16
HOST_WINDOWS_FOR_CAUSE = 6
STACKS_MAX_AGE_S = 120.0
"""Python stacks from stall reports older than this (or 4 sensitivities) belong to another episode."""


@dataclass(frozen=True)
class Examination:
    """One run of the diagnosis: the analysis's report (with the dumps' problems), what was asked."""

    report: AnalysisReport
    text: str
    pods_asked: list[str]
    pods_answered: int
    records_per_ring: int
    suspicion: Finding
    peak_rss_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        """The report document kept in the job's report ConfigMap."""
        return {
            **self.report.to_json(),
            "suspicion": self.suspicion.to_json(),
            "pods_asked": self.pods_asked,
            "records_per_ring": self.records_per_ring,
        }


@dataclass(frozen=True)
class Diagnosis:
    """What is written on the job: the finding it rests on, the pods it blames, when, and the
    examination (the job keeps it as ``writer.diagnosis_status``)."""

    finding: Finding
    pods: list[str]
    time: str
    examination: Examination = field(repr=False)


async def with_node_alerts(finding: Finding, sources: NodeAlertSources | None) -> tuple[Finding, list[str]]:
    """(``finding`` with the firing alerts of its nodes in its evidence; the problems of reading them).
    No source configured, or no node named: the finding unchanged, no problem."""
    if sources is None or not sources.configured or not finding.nodes:
        return finding, []
    alerts, problems = await firing_on(finding.nodes, sources)
    if not alerts:
        return finding, problems
    evidence = {**finding.evidence, NODE_ALERTS: [alert.as_evidence() for alert in alerts]}
    return dataclasses.replace(finding, evidence=evidence), problems


def pods_to_ask(state: JobState, suspicion: Finding, layout: Layout | None, pods: Iterable[SidecarPod]) -> list[str]:
    """Names of the pods whose dumps the analysis needs (see the module docstring)."""
    every = sorted(pod.name for pod in pods)
    wanted: list[int] = []  # ranks, most telling first
    if len(every) <= EVERY_POD_UP_TO:
        return every
    if suspicion.kind is FindingKind.STRAGGLER and suspicion.ranks:
        wanted = _straggler_peers(state, suspicion.ranks, layout)
    elif suspicion.kind is FindingKind.HANG:
        wanted = _hang_witnesses(state, suspicion)
    else:
        wanted = _slowdown_sample(state)
    chosen: list[str] = []
    for rank in wanted:
        pod = state.ranks[rank].pod if rank in state.ranks else None
        if pod in every and pod not in chosen:
            chosen.append(pod)
    if suspicion.kind is FindingKind.HANG:
        chosen += [pod for _, report in state.stalls for pod in [report.pod] if pod in every and pod not in chosen]
    if len(every) > EVERY_POD_UP_TO:
        chosen = chosen[:MAX_PODS]
    return sorted(chosen) or every[:MAX_PODS]


def _straggler_peers(state: JobState, suspects: list[int], layout: Layout | None) -> list[int]:
    wanted = set(suspects)
    if layout is not None and layout.tp > 1:
        coords = {layout.coords(rank)[1:] for rank in suspects if rank < layout.world_size}
        wanted |= {rank for rank in state.ranks if rank < layout.world_size and layout.coords(rank)[1:] in coords}
    else:  # no layout, or no tensor-parallel peers (TP 1): every rank sharing a communicator with a suspect
        comms = {c for rank in suspects if rank in state.ranks for c in state.ranks[rank].comms}
        wanted |= {r.rank for r in state.ranks.values() if comms & set(r.comms)}
    return [*suspects, *sorted(wanted - set(suspects))]


def _hang_witnesses(state: JobState, suspicion: Finding) -> list[int]:
    """Ranks behind on a communicator first, then a few of the members waiting for them; when nobody
    is behind, the members of the communicators with the oldest calls in flight."""
    members: dict[str, dict[int, Any]] = {}
    for rank in state.ranks.values():
        for comm_id, comm in rank.comms.items():
            members.setdefault(comm_id, {})[rank.rank] = comm
    behind: list[int] = list(suspicion.ranks)
    waiters: list[int] = []
    oldest: list[tuple[float, str]] = []
    for comm_id, comms in members.items():
        entered = {rank: comm.last_entered for rank, comm in comms.items() if comm.last_entered is not None}
        if not entered:
            continue
        front = max(entered.values())
        late = sorted(rank for rank, seq in entered.items() if seq < front)
        if late:
            behind += late
            waiters += sorted(rank for rank, seq in entered.items() if seq == front)[:WAITERS_PER_COMMUNICATOR]
        ages = [comm.oldest_in_flight_s for comm in comms.values() if comm.in_flight and comm.oldest_in_flight_s]
        if ages:
            oldest.append((max(ages), comm_id))
    if behind:
        return list(dict.fromkeys(behind + waiters))
    stuck: list[int] = []
    for _, comm_id in sorted(oldest, reverse=True)[:2]:
        stuck += sorted(members[comm_id])
    return list(dict.fromkeys(stuck))


def _slowdown_sample(state: JobState) -> list[int]:
    ranks = sorted(state.ranks)
    slowest = sorted(
        (rank for rank in ranks if state.ranks[rank].step_time_s), key=lambda rank: -state.ranks[rank].step_time_s
    )[:SPREAD_PODS]
    pods = sorted({state.ranks[rank].pod for rank in ranks})
    step = max(1, len(pods) // SPREAD_PODS)
    spread = [next(rank for rank in ranks if state.ranks[rank].pod == pod) for pod in pods[::step]]
    return list(dict.fromkeys(slowest + spread))


def records_limit(state: JobState, pod_names: list[str], window_s: float, dump_budget_bytes: int) -> int:
    """Records per ring: ~HISTORY_SECONDS of the busiest rank's calls, within the byte budget."""
    ranks = [rank for rank in state.ranks.values() if rank.pod in pod_names]
    per_window = max((max(rank.records, default=0) for rank in ranks), default=0)
    wanted = int(per_window * HISTORY_SECONDS / max(window_s, 0.1)) or MAX_RECORDS_PER_RING
    # A ring image is padded to a power of two records: budget for twice the records asked.
    budget = dump_budget_bytes // (2 * RECORD_BYTES) // max(1, len(ranks))
    return max(MIN_RECORDS_PER_RING, min(wanted, MAX_RECORDS_PER_RING, budget))


def host_starved_finding(suspicion: Finding, node_of_rank: dict[int, str], layout: Layout | None) -> Finding:
    """The finding behind a ``host_starved`` suspicion, when the traces cannot single the rank out: a
    rank whose collectives progress on its own starved host (the stand-in NCCL; a CPU-bound collective
    path) is late inside them too, so its waits do not stand out from its peers'. The summaries'
    figures are the evidence: its run-queue delay against the job's other ranks, its group's waits
    against the job's other groups."""
    ranks = [int(rank) for rank in suspicion.evidence["ranks"]]
    first = suspicion.evidence["ranks"][str(ranks[0])]
    where = f" ({layout.describe(ranks[0])})" if layout and ranks[0] < layout.world_size else ""
    share, peers = first["run_delay_ms_per_s"], first["peers_run_delay_ms_per_s"]
    return Finding(
        kind=FindingKind.STRAGGLER,
        ranks=ranks,
        nodes=sorted({node_of_rank.get(rank, "") for rank in ranks} - {""}),
        communicator=first["communicator"],
        confidence=round(min(0.9, 1 - peers / share), 3) if share > 0 else 0.0,
        summary=(
            f"rank {ranks[0]}{where} on node {node_of_rank.get(ranks[0], 'unknown')} holds back its group "
            f"(communicator {first['communicator']}): the group waits {first['group_wait_s'] * 1e3:.2f} ms per "
            f"collective against {first['other_groups_wait_s'] * 1e3:.2f} ms in the job's other groups, while the "
            f"rank's process waits {share:.0f} ms per second for a CPU against {peers:.0f} ms/s of the other ranks"
        ),
        evidence={SOURCE: HOST_STARVED, **first},
    )


@dataclass(frozen=True)
class DiagnosisBudget:
    """What one diagnosis may use (``config.DiagnosisLimits`` divided among the concurrent ones)."""

    memory_bytes: int
    timeout_s: float

    @property
    def dump_bytes(self) -> int:
        return int(self.memory_bytes * DUMP_SHARE_OF_WORKER_MEMORY)


async def diagnose(
    state: JobState,
    suspicion: Finding,
    layout: Layout | None,
    pods: list[SidecarPod],
    token: str,
    sensitivity_s: float,
    window_s: float,
    budget: DiagnosisBudget,
    node_alerts: NodeAlertSources | None = None,
) -> tuple[Diagnosis | None, Examination]:
    """(the diagnosis, or None when the analysis blames no rank; what was examined either way).
    With ``node_alerts``, the diagnosis carries the firing alerts of the nodes it names (a source's
    trouble is one of its problems, never a failure). Raises ``worker.WorkerFailed`` when the analysis
    ran out of memory or time."""
    names = pods_to_ask(state, suspicion, layout, pods)
    chosen = [pod for pod in pods if pod.name in names]
    limit = records_limit(state, names, window_s, budget.dump_bytes)
    # Where each rank's pod is bound, as the API server says (the job's own pods), else as its sidecar says.
    bound = {pod.name: pod.node for pod in pods}
    node_of_rank = {rank: bound.get(r.pod) or state.node_of_pod(r.pod) or r.node for rank, r in state.ranks.items()}
    pod_of_rank = {rank: r.pod for rank, r in state.ranks.items()}
    request = worker.AnalysisRequest(
        layout.tp if layout else None,
        layout.pp if layout else None,
        layout.world_size if layout else None,
        node_of_rank,
        # A call pending half the sensitivity is already a wait worth following; the stall itself was
        # established by the detector.
        max(1.0, min(sensitivity_s / 2, 60.0)),
        time.time_ns(),  # just before the dumps are asked for
    )
    with tempfile.TemporaryDirectory(prefix="rankwatch-diagnosis-") as temporary:
        directory = Path(temporary)
        per_pod = 2 * budget.dump_bytes // max(1, len(chosen)) + CHUNK_BYTES
        answered, problems = await fetch_dumps(chosen, token, limit, directory, per_pod)
        if not answered:
            report = AnalysisReport([], problems or ["no dumps"])
            return None, Examination(report, "\n".join(report.problems), names, 0, limit, suspicion)
        result = await worker.analyse(directory, request, budget.memory_bytes, budget.timeout_s)
    # the cause again, now with the hosts' scheduling figures from the summaries of the last windows
    host = state.host_loads(time.monotonic(), HOST_WINDOWS_FOR_CAUSE * window_s + window_s / 2)
    stacks = latest_stacks(state, time.monotonic() - max(STACKS_MAX_AGE_S, 4 * sensitivity_s))
    findings = [with_python_stacks(attribute(finding, host), stacks) for finding in result.report.findings]
    report = AnalysisReport(findings, problems + result.report.problems)
    text = result.text + "".join(f"\nwarning: {problem}" for problem in problems)
    text += "".join(
        f"\n{finding.kind.value.upper()} ranks {finding.ranks}, with the hosts' scheduling: {finding.cause_text}"
        for finding in findings
    )
    # A slowdown that blames no rank (the whole job's step time drifting, with no straggler behind it)
    # is the machine or the environment, not a fault rankwatch can localise or cordon: it is logged
    # with the report, and the job is not marked Degraded for it.
    for finding in report.findings:
        if not finding.ranks and finding.kind not in (FindingKind.HANG, FindingKind.MISMATCH):
            report.problems.append(f"job-wide, no rank behind it (not a diagnosis): {finding.summary}")
    blaming = [finding for finding in report.findings if finding.ranks]
    if not blaming and suspicion.evidence.get(SOURCE) == HOST_STARVED:
        starved = attribute(host_starved_finding(suspicion, node_of_rank, layout), host)
        if starved.cause is Cause.HOST:  # still starved now, by the same rule the detector used
            report.findings.insert(0, starved)
            blaming = [starved]
            text += f"\n{starved.kind.value.upper()} (from the summaries): {starved.summary}\n  {starved.cause_text}"
    if blaming:
        endpoints = {pod.name: pod.endpoint for pod in pods}
        finding, profile_problems = await with_differential_profile(blaming[0], state, endpoints, token)
        finding, alert_problems = await with_node_alerts(finding, node_alerts)
        report.findings[report.findings.index(blaming[0])] = finding
        report.problems.extend(profile_problems + alert_problems)
        text += "".join(f"\nwarning: {problem}" for problem in profile_problems + alert_problems)
        if finding.summary != blaming[0].summary:
            text += f"\n{finding.summary}"
        text += "".join(f"\nnode alert: {line}" for line in node_alert_lines(finding.evidence))
    examination = Examination(report, text, names, answered, limit, suspicion, result.peak_rss_bytes)
    if not blaming:
        # A stopped job whose culprit the evidence cannot single out is still hung: it is reported as
        # such, naming nobody (so nothing is cordoned), rather than not at all.
        # So is a mismatch whose odd side is undecided: the job's owner is paged, nothing cordoned.
        unlocalised = [
            f
            for f in report.findings
            if (f.kind is FindingKind.HANG and suspicion.kind is FindingKind.HANG) or f.kind is FindingKind.MISMATCH
        ]
        return (Diagnosis(unlocalised[0], [], _now(), examination) if unlocalised else None), examination
    blamed_pods = sorted({pod_of_rank[rank] for rank in finding.ranks if rank in pod_of_rank})
    return Diagnosis(finding, blamed_pods, _now(), examination), examination
