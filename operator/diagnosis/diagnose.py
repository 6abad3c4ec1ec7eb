"""Diagnosis on suspicion: pull the raw records from the sidecars that matter, run
``rankwatch.analysis`` on them off the event loop, and say what is wrong in a ``Diagnosis``.

Which sidecars: for a straggler the suspects' pods and those of their tensor-parallel peers (the
comparison the analysis needs); for a hang or a slowdown every pod, with fewer records per ring as
the job grows (a fixed byte budget), because the culprit of a hang can be anywhere.

Where a sidecar is: the pod annotation ``rankwatch.io/sidecar-endpoint`` (a base URL) when set, else
``http://<pod IP>:<sidecar metrics port>``. The annotation exists for clusters whose pod IPs are not
reachable from the operator (the local kwok cluster, where the e2e pod runner sets it).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from rankwatch import protocol
from rankwatch.analysis.analyze import analyze, summary_text
from rankwatch.analysis.topology import Layout
from rankwatch.analysis.trace import RankSource, load_path
from rankwatch.operator.diagnosis.detector import Suspicion
from rankwatch.operator.diagnosis.job_state import JobState
from rankwatch.sidecar.dump import split_dump

log = logging.getLogger(__name__)

SIDECAR_ENDPOINT_ANNOTATION = "rankwatch.io/sidecar-endpoint"
DUMP_BUDGET_BYTES = 256 << 20
"""Records fetched per diagnosis at most (128 bytes each): 2M records, e.g. 2,000 per rank at 1,000 ranks."""
MAX_RECORDS_PER_RING = 20_000
MIN_RECORDS_PER_RING = 500
HISTORY_SECONDS = 30.0
"""How much recent history a ring's dump should cover, when the summaries tell its call rate."""
FETCH_TIMEOUT_S = 15.0
FETCH_CONCURRENCY = 16

KINDS = {"hang": "Hang", "straggler": "Straggler", "slow_link": "SlowLink", "fail_slow": "FailSlow"}
"""Analysis finding kinds as written on the job; a hang inside a collective is ``StuckInCollective``."""
HUNG_KINDS = ("Hang", "StuckInCollective")


@dataclass(frozen=True)
class SidecarPod:
    """A worker pod as the diagnosis needs it."""

    name: str
    node: str
    endpoint: str | None  # base URL of its sidecar, None when it has no address yet

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any], sidecar_port: int) -> SidecarPod:
        metadata, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        endpoint = (metadata.get("annotations") or {}).get(SIDECAR_ENDPOINT_ANNOTATION)
        if not endpoint and status.get("podIP"):
            endpoint = f"http://{status['podIP']}:{sidecar_port}"
        return cls(metadata["name"], spec.get("nodeName") or "", endpoint.rstrip("/") if endpoint else None)


@dataclass(frozen=True)
class Diagnosis:
    """What is written on the job. ``finding`` is the analysis finding (schema 1) it rests on."""

    kind: str  # Hang | StuckInCollective | Straggler | SlowLink | FailSlow
    ranks: list[int]
    nodes: list[str]
    pods: list[str]
    confidence: float
    summary: str
    time: str
    finding: dict[str, Any]
    suspicion: str
    report: dict[str, Any] = field(repr=False, default_factory=dict)
    text: str = field(repr=False, default="")

    @property
    def hung(self) -> bool:
        return self.kind in HUNG_KINDS

    @property
    def condition(self) -> str:
        return "Hung" if self.hung else "Degraded"


def finding_kind(finding: Mapping[str, Any]) -> str:
    if finding["kind"] == "hang" and (finding.get("evidence") or {}).get("stuck"):
        return "StuckInCollective"
    return KINDS.get(finding["kind"], finding["kind"])


def pods_to_ask(state: JobState, suspicion: Suspicion, layout: Layout | None, pods: Iterable[SidecarPod]) -> list[str]:
    """Names of the pods whose dumps the analysis needs (see the module docstring)."""
    every = sorted(pod.name for pod in pods)
    if suspicion.kind != "straggler" or not suspicion.ranks:
        return every
    wanted_ranks = set(suspicion.ranks)
    if layout is not None:
        coords = {layout.coords(rank)[1:] for rank in suspicion.ranks if rank < layout.world_size}
        wanted_ranks |= {rank for rank in state.ranks if rank < layout.world_size and layout.coords(rank)[1:] in coords}
    else:  # no layout: every rank sharing a communicator with a suspect
        comms = {c for rank in suspicion.ranks if rank in state.ranks for c in state.ranks[rank].comms}
        wanted_ranks |= {r.rank for r in state.ranks.values() if comms & set(r.comms)}
    chosen = {state.ranks[rank].pod for rank in wanted_ranks if rank in state.ranks}
    return [name for name in every if name in chosen] or every


def records_limit(state: JobState, pod_names: list[str], window_s: float) -> int:
    """Records per ring: ~HISTORY_SECONDS of the busiest rank's calls, within the budget."""
    ranks = [rank for rank in state.ranks.values() if rank.pod in pod_names]
    per_window = max((max(rank.records, default=0) for rank in ranks), default=0)
    wanted = int(per_window * HISTORY_SECONDS / max(window_s, 0.1)) or MAX_RECORDS_PER_RING
    budget = DUMP_BUDGET_BYTES // 128 // max(1, len(ranks))
    return max(MIN_RECORDS_PER_RING, min(wanted, MAX_RECORDS_PER_RING, budget))


async def fetch_dumps(pods: list[SidecarPod], token: str, limit: int, directory: Path) -> tuple[list[Path], list[str]]:
    """Write each pod's ring images into ``directory``; (files written, problems)."""
    problems: list[str] = []
    files: list[Path] = []
    semaphore = asyncio.Semaphore(FETCH_CONCURRENCY)
    timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)

    async def one(session: aiohttp.ClientSession, pod: SidecarPod) -> None:
        if not pod.endpoint:
            problems.append(f"pod {pod.name}: no sidecar address (no pod IP and no {SIDECAR_ENDPOINT_ANNOTATION})")
            return
        url = f"{pod.endpoint}{protocol.DUMP_PATH}"
        async with semaphore:
            try:
                async with session.get(
                    url, params={"limit": str(limit)}, headers={"Authorization": protocol.bearer(token)}
                ) as response:
                    if response.status != 200:
                        problems.append(f"pod {pod.name}: sidecar answered HTTP {response.status} to /dump")
                        return
                    body = await response.read()
            except (aiohttp.ClientError, TimeoutError) as error:
                problems.append(
                    f"pod {pod.name}: sidecar at {pod.endpoint} unreachable: {error or type(error).__name__}"
                )
                return
        try:
            images = split_dump(body)
        except protocol.ProtocolError as error:
            problems.append(f"pod {pod.name}: {error}")
            return
        for index, image in enumerate(images):
            path = directory / f"{pod.name}-{index}.ring"
            await asyncio.to_thread(path.write_bytes, image)
            files.append(path)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(session, pod) for pod in pods))
    return files, problems


def run_analysis(
    directory: Path, layout: Layout | None, node_of_rank: Mapping[int, str], stall_seconds: float
) -> tuple[dict[str, Any], str]:
    """The analysis report and its text form (blocking: call it in a worker thread)."""
    trace = load_path(directory)
    trace.layout = layout if layout and (not trace.ranks or max(trace.ranks) < layout.world_size) else None
    for rank, source in list(trace.ranks.items()):
        if source.node in ("", "unknown") and node_of_rank.get(rank):
            trace.ranks[rank] = RankSource(rank, node_of_rank[rank], source.pid, source.path)
    document = analyze(trace, "all", stall_seconds)
    return document, summary_text(document, trace)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


async def diagnose(
    state: JobState,
    suspicion: Suspicion,
    layout: Layout | None,
    pods: list[SidecarPod],
    token: str,
    sensitivity_s: float,
    window_s: float,
) -> tuple[Diagnosis | None, dict[str, Any]]:
    """(the diagnosis, or None when the analysis finds nothing; the full report either way)."""
    names = pods_to_ask(state, suspicion, layout, pods)
    chosen = [pod for pod in pods if pod.name in names]
    limit = records_limit(state, names, window_s)
    node_of_rank = {rank: state.node_of_pod(r.pod) or r.node for rank, r in state.ranks.items()}
    pod_of_node_rank = {rank: r.pod for rank, r in state.ranks.items()}
    with tempfile.TemporaryDirectory(prefix="rankwatch-diagnosis-") as temporary:
        directory = Path(temporary)
        files, problems = await fetch_dumps(chosen, token, limit, directory)
        if not files:
            report = {"schema": 1, "healthy": True, "findings": [], "problems": problems or ["no dumps"]}
            return None, report
        # A call pending half the sensitivity is already a wait worth following; the stall itself was
        # established by the detector.
        stall_seconds = max(1.0, min(sensitivity_s / 2, 60.0))
        document, text = await asyncio.to_thread(run_analysis, directory, layout, node_of_rank, stall_seconds)
    document["problems"] = problems + list(document.get("problems") or [])
    document["suspicion"] = asdict(suspicion)
    document["pods_asked"] = names
    document["records_per_ring"] = limit
    if problems:
        text += "\n" + "\n".join(f"warning: {problem}" for problem in problems)
    # A finding that blames no rank (the whole job's step time drifting, with no straggler behind it)
    # is the machine or the environment, not a fault rankwatch can localise or cordon: it is logged
    # with the report, and the job is not marked Degraded for it.
    blaming = [finding for finding in document["findings"] if finding["ranks"]]
    for finding in document["findings"]:
        if not finding["ranks"]:
            document["problems"].append(f"job-wide, no rank behind it (not a diagnosis): {finding['summary']}")
    if not blaming:
        return None, document
    finding = blaming[0]
    pod_names = sorted({pod_of_node_rank[rank] for rank in finding["ranks"] if rank in pod_of_node_rank})
    diagnosis = Diagnosis(
        kind=finding_kind(finding),
        ranks=sorted(finding["ranks"]),
        nodes=sorted(finding["nodes"]),
        pods=pod_names,
        confidence=round(float(finding["confidence"]), 2),
        summary=finding["summary"],
        time=_now(),
        finding=finding,
        suspicion=suspicion.summary,
        report=document,
        text=text,
    )
    return diagnosis, document
