"""The operator's one client of the job's sidecars: where a pod's sidecar is, and one bounded download
of what it serves (``/dump`` for the diagnosis and the archive, ``/evidence`` for the archive).

Where a sidecar is: ``http://<pod IP>:<sidecar metrics port>``, nothing else. Whoever may edit a pod
may set annotations, so the pod annotation ``rankwatch.io/sidecar-endpoint`` (a base URL, for clusters
whose pod IPs the operator cannot reach, such as the local kwok cluster where the pod runner sets it)
is honoured only when its host is one the operator's own configuration trusts
(``RANKWATCH_SIDECAR_ENDPOINT_HOSTS``; empty by default): the job's token is never sent anywhere else.
Responses are streamed to files, never held in the operator's memory, and each is bounded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from rankwatch import protocol

log = logging.getLogger(__name__)

SIDECAR_ENDPOINT_ANNOTATION = "rankwatch.io/sidecar-endpoint"
FETCH_TIMEOUT_S = 15.0
FETCH_CONCURRENCY = 16
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class SidecarPod:
    """A worker pod as the diagnosis needs it."""

    name: str
    node: str
    endpoint: str | None  # base URL of its sidecar, None when it has no address yet

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any], sidecar_port: int, trusted_hosts: Collection[str] = ()) -> SidecarPod:
        """The pod's sidecar at its pod IP; the endpoint annotation only when its host is trusted."""
        metadata, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        endpoint = None
        annotated = (metadata.get("annotations") or {}).get(SIDECAR_ENDPOINT_ANNOTATION)
        if annotated:
            endpoint = trusted_endpoint(annotated, trusted_hosts)
            if endpoint is None:
                log.warning(
                    "pod %s/%s: annotation %s=%r ignored: its host is not in RANKWATCH_SIDECAR_ENDPOINT_HOSTS; "
                    "the sidecar is asked at the pod IP",
                    metadata.get("namespace", ""), metadata["name"], SIDECAR_ENDPOINT_ANNOTATION, annotated[:200],
                )  # fmt: skip
        if endpoint is None and status.get("podIP"):
            endpoint = f"http://{_host_in_url(status['podIP'])}:{sidecar_port}"
        return cls(metadata["name"], spec.get("nodeName") or "", endpoint)


def trusted_endpoint(url: str, trusted_hosts: Collection[str]) -> str | None:
    """``scheme://host:port`` of ``url`` when it is a plain http(s) base URL on a trusted host, else None.
    Path, query, user info and fragment are dropped: only the host and port come from the pod."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password:
        return None
    if parts.hostname not in trusted_hosts:
        return None
    return f"{parts.scheme}://{_host_in_url(parts.hostname)}{f':{port}' if port else ''}"


def _host_in_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class ByteAllowance:
    """Bytes that may still be written, over every pod and file of one archive: one total, so the
    number of pods does not multiply what an archive may take (memory of the worker, the disk)."""

    def __init__(self, total: int) -> None:
        self.total = self.left = total

    def take(self, count: int) -> bool:
        if count > self.left:
            return False
        self.left -= count
        return True

    def give_back(self, count: int) -> None:
        self.left = min(self.total, self.left + count)

    def refusal(self) -> str:
        return f"the archive's budget of {self.total >> 20} MiB is spent"


class Refused(Exception):
    """A sidecar's answer not taken: an error status, or more bytes than it may send."""


async def download(
    session: aiohttp.ClientSession,
    pod: SidecarPod,
    path: str,
    token: str,
    target: Path,
    max_bytes: int,
    allowance: ByteAllowance | None = None,
    params: Mapping[str, str] | None = None,
) -> int:
    """Stream ``path`` of the pod's sidecar into ``target``; the bytes written. A sidecar is not trusted
    more than any HTTP peer: past ``max_bytes`` or what is left of ``allowance`` the file is removed,
    the allowance given back and ``Refused`` raised; so on any other failure (``aiohttp.ClientError``,
    ``TimeoutError``), which propagates."""
    written = 0
    try:
        async with session.get(
            f"{pod.endpoint}{path}", params=dict(params or {}), headers={"Authorization": protocol.bearer(token)}
        ) as response:
            if response.status != 200:
                raise Refused(f"sidecar answered HTTP {response.status} to {path}")
            with target.open("wb") as out:
                async for chunk in response.content.iter_chunked(CHUNK_BYTES):
                    if written + len(chunk) > max_bytes:
                        raise Refused(f"{path} sent more than {max_bytes >> 20} MiB; skipped")
                    if allowance is not None and not allowance.take(len(chunk)):
                        raise Refused(f"{path}: {allowance.refusal()}; skipped")
                    written += len(chunk)
                    out.write(chunk)
    except BaseException:
        target.unlink(missing_ok=True)
        if allowance is not None:
            allowance.give_back(written)
        raise
    return written


async def fetch_dumps(
    pods: list[SidecarPod],
    token: str,
    limit: int,
    directory: Path,
    max_bytes_per_pod: int,
    allowance: ByteAllowance | None = None,
) -> tuple[int, list[str]]:
    """Stream each pod's ``/dump`` into ``directory/<pod>.dump``; (pods answered, problems). With an
    ``allowance``, a dump that would go past it is dropped (and named) as one too large is."""
    problems: list[str] = []
    answered = 0
    semaphore = asyncio.Semaphore(FETCH_CONCURRENCY)

    async def one(session: aiohttp.ClientSession, pod: SidecarPod) -> None:
        nonlocal answered
        if not pod.endpoint:
            problems.append(f"pod {pod.name}: no sidecar address (no pod IP and no {SIDECAR_ENDPOINT_ANNOTATION})")
            return
        async with semaphore:
            try:
                target = directory / f"{pod.name}.dump"
                await download(session, pod, protocol.DUMP_PATH, token, target, max_bytes_per_pod, allowance,
                               {"limit": str(limit)})  # fmt: skip
            except Refused as error:
                problems.append(f"pod {pod.name}: {error}")
                return
            except (aiohttp.ClientError, TimeoutError) as error:
                problems.append(
                    f"pod {pod.name}: sidecar at {pod.endpoint} unreachable: {error or type(error).__name__}"
                )
                return
        answered += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)) as session:
        await asyncio.gather(*(one(session, pod) for pod in pods))
    return answered, problems
