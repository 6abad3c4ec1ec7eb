"""What a straggler is slower *in*: its Python profile against two healthy peers' over the same seconds.

On a straggler finding the diagnosis asks the sidecars (``/profile``, py-spy, bounded and rate-limited
there) for a few seconds of the culprit's Python and of two peers from its communicator, preferring
its own pod's (one request). A function's share is the fraction of a rank's samples whose stack
contains it; the functions whose share in the culprit differs most from the peers' median are where
it spends its extra time (a slower ``backward``) or the time its peers spend waiting for it (a
smaller ``all_reduce``): "rank 5 spends 74% of its time in backward (python_rank.py) against 43% for
ranks 4, 6". Differential observability, after PerfTracker.

Nothing here fails a diagnosis: a sidecar that does not answer, a rank that is not Python (a C
trainer has no Python to sample) or a profile refused as too soon leaves the finding as it was and
says why in the diagnosis' problems.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

from rankwatch import protocol
from rankwatch.model.finding import Finding, FindingKind
from rankwatch.operator.diagnosis.ingest.job_state import JobState

PROFILE_SECONDS = 3
PEERS = 2
MIN_DIFFERENCE = 0.05
"""Shares closer than 5 points are noise at 50 Hz over a few seconds (150 samples)."""
SHOWN = 3
PROFILE_ANSWER_MAX_BYTES = 4 << 20
"""A profile answer is function names and counts: anything larger is not one (and is not read whole)."""
EVIDENCE_KEY = "python_profile"


@dataclass(frozen=True)
class Profile:
    """One rank's samples: total, and per function how many contained it."""

    samples: int
    functions: dict[str, int]

    def share(self, function: str) -> float:
        return self.functions.get(function, 0) / self.samples if self.samples else 0.0


@dataclass(frozen=True)
class FunctionDifference:
    function: str
    culprit_share: float
    peers_share: float  # the median over the peers

    @property
    def difference(self) -> float:
        return self.culprit_share - self.peers_share


def peers_of(state: JobState, culprit: int, count: int = PEERS) -> list[int]:
    """Up to ``count`` ranks sharing a communicator with ``culprit``, its own pod's first."""
    me = state.ranks.get(culprit)
    if me is None:
        return []
    mates = [r for r in state.ranks.values() if r.rank != culprit and set(r.comms) & set(me.comms)]
    mates.sort(key=lambda r: (r.pod != me.pod, abs(r.rank - culprit), r.rank))
    return [r.rank for r in mates[:count]]


def compare(culprit: Profile, peers: Mapping[int, Profile]) -> list[FunctionDifference]:
    """The functions whose share differs most (at least :data:`MIN_DIFFERENCE`), largest first."""
    sampled = [profile for profile in peers.values() if profile.samples]
    if not culprit.samples or not sampled:
        return []
    functions = set(culprit.functions).union(*(profile.functions for profile in sampled))
    differences = [
        FunctionDifference(function, culprit.share(function), statistics.median(p.share(function) for p in sampled))
        for function in functions
    ]
    differences = [d for d in differences if abs(d.difference) >= MIN_DIFFERENCE]
    return sorted(differences, key=lambda d: (-abs(d.difference), d.function))[:SHOWN]


def sentence(culprit: int, peers: list[int], differences: list[FunctionDifference], seconds: int) -> str:
    them = f"rank{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))}"
    parts = [
        f"{d.culprit_share:.0%} of its time in {d.function} against {d.peers_share:.0%} for {them}"
        if index == 0
        else f"{d.culprit_share:.0%} in {d.function} against {d.peers_share:.0%}"
        for index, d in enumerate(differences)
    ]
    return f"Python profile ({seconds} s, sampled with its peers): rank {culprit} spends " + "; ".join(parts)


async def fetch_profiles(
    endpoints: Mapping[int, str | None], token: str, seconds: int = PROFILE_SECONDS
) -> tuple[dict[int, Profile], list[str]]:
    """Rank -> profile, from each pod's sidecar (one request per pod, all at once); and the problems."""
    by_endpoint: dict[str, list[int]] = {}
    problems: list[str] = []
    for rank, endpoint in endpoints.items():
        if endpoint:
            by_endpoint.setdefault(endpoint, []).append(rank)
        else:
            problems.append(f"no Python profile of rank {rank}: its sidecar has no address")
    profiles: dict[int, Profile] = {}
    timeout = aiohttp.ClientTimeout(total=seconds + 15)

    async def one(session: aiohttp.ClientSession, endpoint: str, ranks: list[int]) -> None:
        try:
            async with session.get(
                f"{endpoint}{protocol.PROFILE_PATH}",
                params={"ranks": ",".join(map(str, ranks)), "seconds": str(seconds)},
                headers={"Authorization": protocol.bearer(token)},
            ) as response:
                body = bytearray()
                async for chunk in response.content.iter_chunked(1 << 16):
                    body += chunk
                    if len(body) > PROFILE_ANSWER_MAX_BYTES:
                        break
                if response.status != 200:
                    reason = bytes(body[:200]).decode(errors="replace").strip()
                    problems.append(f"no Python profile of ranks {ranks}: sidecar at {endpoint} answered HTTP "
                                    f"{response.status} ({reason})")  # fmt: skip
                    return
                if len(body) > PROFILE_ANSWER_MAX_BYTES:
                    problems.append(f"no Python profile of ranks {ranks}: sidecar at {endpoint} answered more "
                                    f"than {PROFILE_ANSWER_MAX_BYTES >> 20} MiB")  # fmt: skip
                    return
                document = json.loads(body)
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            problems.append(
                f"no Python profile of ranks {ranks}: sidecar at {endpoint}: {error or type(error).__name__}"
            )
            return
        for rank in ranks:
            data = ((document or {}).get("ranks") or {}).get(str(rank)) or {}
            try:
                samples, functions = int(data.get("samples") or 0), dict(data.get("functions") or {})
                functions = {str(name): int(count) for name, count in functions.items()}
            except (TypeError, ValueError, AttributeError):
                problems.append(f"no Python profile of rank {rank}: the sidecar's answer is malformed")
                continue
            if samples:
                profiles[rank] = Profile(samples, functions)
            elif data.get("python") is False:
                continue  # a rank that runs no Python (a C trainer) has no profile to miss
            else:
                problems.append(f"no Python profile of rank {rank}: {data.get('problem') or 'no samples'}")

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(session, endpoint, ranks) for endpoint, ranks in by_endpoint.items()))
    return profiles, problems


async def with_differential_profile(
    finding: Finding, state: JobState, endpoint_of_pod: Mapping[str, str | None], token: str
) -> tuple[Finding, list[str]]:
    """A straggler ``finding`` with the functions its culprit's profile differs most in from its peers'
    (summary and ``evidence.python_profile``); other findings unchanged. Never raises for a sidecar's
    trouble: (the finding as it was, the problems)."""
    if finding.kind is not FindingKind.STRAGGLER or not finding.ranks:
        return finding, []
    culprit = sorted(finding.ranks)[0]
    peers = [rank for rank in peers_of(state, culprit) if rank not in finding.ranks]
    if not peers:
        return finding, [f"no Python profile of rank {culprit}: no peer of it is known to compare with"]
    endpoints = {rank: endpoint_of_pod.get(state.ranks[rank].pod) for rank in [culprit, *peers]}
    profiles, problems = await fetch_profiles(endpoints, token)
    culprit_profile = profiles.get(culprit)
    compared = {rank: profiles[rank] for rank in peers if rank in profiles}
    if culprit_profile is None or not compared:
        return finding, problems
    differences = compare(culprit_profile, compared)
    evidence = {
        **finding.evidence,
        EVIDENCE_KEY: {
            "seconds": PROFILE_SECONDS,
            "culprit": culprit,
            "peers": sorted(compared),
            "samples": {str(rank): profiles[rank].samples for rank in [culprit, *sorted(compared)]},
            "differences": [
                {
                    "function": d.function,
                    "culprit_share": round(d.culprit_share, 3),
                    "peers_share": round(d.peers_share, 3),
                }
                for d in differences
            ],
        },
    }
    if not differences:
        summary = (
            f"{finding.summary}. Python profile ({PROFILE_SECONDS} s): no function's share differs from its peers'"
        )
    else:
        summary = f"{finding.summary}. {sentence(culprit, sorted(compared), differences, PROFILE_SECONDS)}"
    return dataclasses.replace(finding, summary=summary, evidence=evidence), problems
