"""Gather an attempt's evidence into a local directory, while its sidecars still answer.

Layout (what ``rankwatch analyze`` reads back, see ``rankwatch.analysis.archive``)::

    manifest.json          job, attempt, reason, time, pods -> nodes, files, problems (written last)
    rings/<pod>-<i>.ring   every rank's ring window, from each sidecar's /dump
    files/<pod>/...        the stall watch's Megatrace logs and flight-recorder dumps (/evidence)
    diagnosis.json/.txt    the diagnosis report the job carried (its ConfigMap), when there was one
    report.html            the analysis of the rings above: findings, step time, wait heatmap
    timeline.json          the same as a Chrome trace / Perfetto timeline (ui.perfetto.dev)

A sidecar that does not answer is a problem listed in the manifest, not a failure: the rest is kept.

Everything a job's sidecars send is untrusted and may be large (a 64-rank job comes to about 2 GiB):
the operator only streams it to files, within one byte budget for the whole archive
(:class:`EvidenceLimits`), and the parsing and rendering run in the diagnosis' bounded worker
process (``rankwatch.operator.diagnosis.diagnose.worker``: address-space and time limits). What does not fit
is named in the manifest's problems (and so in ``status.archives``).
"""

from __future__ import annotations

import asyncio
import json
import tarfile
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import aiohttp

from rankwatch import protocol
from rankwatch.analysis.topology import Layout
from rankwatch.operator.diagnosis.diagnose.worker import WorkerFailed, render_evidence
from rankwatch.operator.sidecar_client import (
    FETCH_CONCURRENCY,
    ByteAllowance,
    Refused,
    SidecarPod,
    download,
    fetch_dumps,
)

MANIFEST = "manifest.json"
SCHEMA = 1
RECORDS_PER_RING = 20_000
"""Records kept per rank (128 bytes each): the last 20,000 calls, tens of seconds to minutes of a job."""
BUDGET_BYTES = 1 << 30
"""Ring records fetched from one pod at most."""
MIN_RECORDS_PER_RING = 500
FETCH_TIMEOUT_S = 30.0
MAX_EVIDENCE_BYTES = 272 << 20
"""Largest /evidence tar taken from one pod: a sidecar sends at most 256 MiB of files (sidecar/evidence.py)
plus their tar headers."""


@dataclass(frozen=True)
class EvidenceLimits:
    """What one archive may take: bytes on disk in all (dumps and files of every pod together), and
    the memory and time of the worker that renders it."""

    budget_bytes: int = 512 << 20
    """The chart gives the operator 768 MiB of /tmp; the upload streams from there."""
    memory_bytes: int = 256 << 20
    timeout_s: float = 300.0

    @property
    def ring_bytes(self) -> int:
        """The rings' share: the rest is for the pods' /evidence files."""
        return self.budget_bytes * 3 // 4


@dataclass
class Manifest:
    """What an archive holds; ``manifest.json`` (schema 1)."""

    namespace: str
    job: str
    uid: str
    attempt: int
    reason: str
    time: str
    pods: dict[str, str] = field(default_factory=dict)  # pod -> node
    diagnosis: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)
    """The analysis of the archived rings (what report.html shows)."""
    layout: dict[str, int] = field(default_factory=dict)
    """tensor, pipeline, world_size: ``rankwatch analyze`` names coordinates with it."""
    schema: int = SCHEMA


def records_per_ring(ranks: int, budget_bytes: int = BUDGET_BYTES) -> int:
    return max(MIN_RECORDS_PER_RING, min(RECORDS_PER_RING, budget_bytes // 128 // max(1, ranks)))


def _safe_members(archive: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """Regular files with relative paths that stay inside the destination (a sidecar is not trusted
    more than any HTTP peer)."""
    members = []
    for member in archive.getmembers():
        path = PurePosixPath(member.name)
        if member.isfile() and not path.is_absolute() and ".." not in path.parts:
            members.append(member)
    return members


async def fetch_files(
    pods: list[SidecarPod],
    token: str,
    directory: Path,
    max_bytes_per_pod: int = MAX_EVIDENCE_BYTES,
    allowance: ByteAllowance | None = None,
) -> tuple[list[Path], list[str]]:
    """Each pod's /evidence tar, unpacked under ``directory/<pod>/``; (files, problems). A sidecar is
    not trusted more than any HTTP peer: the tar is streamed to a file and refused past
    ``max_bytes_per_pod`` (as sent, and unpacked: compressed tars are refused), or past what is
    left of ``allowance`` (tar and unpacked files together)."""
    files: list[Path] = []
    problems: list[str] = []
    semaphore = asyncio.Semaphore(FETCH_CONCURRENCY)
    directory.mkdir(parents=True, exist_ok=True)

    async def one(session: aiohttp.ClientSession, pod: SidecarPod) -> None:
        if not pod.endpoint:
            return  # fetch_dumps names it already
        tar_path = directory / f".{pod.name}.evidence.tar"
        async with semaphore:
            try:
                written = await download(
                    session, pod, protocol.EVIDENCE_PATH, token, tar_path, max_bytes_per_pod, allowance
                )
            except Refused as error:
                problems.append(f"pod {pod.name}: {error}")
                return
            except (aiohttp.ClientError, TimeoutError) as error:
                problems.append(f"pod {pod.name}: /evidence unreachable: {error or type(error).__name__}")
                return

        def unpack() -> list[Path]:
            target = directory / pod.name
            try:
                with tarfile.open(tar_path, mode="r:") as archive:
                    members = _safe_members(archive)
                    size = sum(member.size for member in members)
                    if size > max_bytes_per_pod:
                        raise tarfile.TarError(f"its files add up to more than {max_bytes_per_pod >> 20} MiB")
                    # The tar's bytes are freed as it is unpacked: its files take their place in the budget.
                    if allowance is not None and not allowance.take(max(0, size - written)):
                        raise tarfile.TarError(f"its files do not fit: {allowance.refusal()}")
                    archive.extractall(target, members=members, filter="data")
            finally:
                tar_path.unlink(missing_ok=True)
            return [target / member.name for member in members]

        try:
            files.extend(await asyncio.to_thread(unpack))
        except (tarfile.TarError, OSError) as error:
            problems.append(f"pod {pod.name}: /evidence is not a readable tar: {error}")

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)) as session:
        await asyncio.gather(*(one(session, pod) for pod in pods))
    return files, problems


async def collect(
    directory: Path,
    manifest: Manifest,
    pods: list[SidecarPod],
    token: str | None,
    layout: Layout | None,
    report: dict[str, str] | None,
    ranks: int,
    limits: EvidenceLimits | None = None,
) -> Manifest:
    """Fill ``directory`` with the attempt's evidence and return the manifest (also written there).

    Only streaming happens here; the dumps are cut into rings and rendered in the worker."""
    limits = limits or EvidenceLimits()
    directory.mkdir(parents=True, exist_ok=True)
    manifest.pods = {pod.name: pod.node for pod in pods}
    allowance = ByteAllowance(limits.budget_bytes)
    if token is None:
        manifest.problems.append("the job's token Secret is gone: the sidecars could not be asked")
    else:
        (directory / "rings").mkdir(exist_ok=True)
        records = records_per_ring(ranks, limits.ring_bytes)
        _, dump_problems = await fetch_dumps(pods, token, records, directory / "rings", BUDGET_BYTES, allowance)
        _, file_problems = await fetch_files(pods, token, directory / "files", allowance=allowance)
        manifest.problems += dump_problems + file_problems
    if report:
        (directory / "diagnosis.json").write_text(report.get("report.json", ""))
        (directory / "diagnosis.txt").write_text(report.get("report.txt", ""))
    shape = None if layout is None else (layout.tp, layout.pp, layout.world_size)
    try:
        rendered = await render_evidence(directory, shape, limits.memory_bytes, limits.timeout_s, manifest.pods)
        manifest.findings = rendered.findings
        manifest.problems += rendered.problems
    except WorkerFailed as error:
        manifest.problems.append(f"the evidence was not analysed (dumps not yet cut into rings are left out): {error}")
    for dump in (directory / "rings").glob("*.dump"):  # a worker that stopped early leaves them uncut
        dump.unlink()
    manifest.files = sorted(str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file())
    manifest.files.append(MANIFEST)
    (directory / MANIFEST).write_text(json.dumps(asdict(manifest), indent=1, default=str))
    return manifest
