"""What a detector reports: a finding with ranks, nodes, a confidence, a summary and numbers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA = 1


@dataclass(frozen=True)
class Finding:
    kind: str  # hang | straggler | slow_link | fail_slow
    ranks: list[int]
    nodes: list[str]
    communicator: str | None
    confidence: float  # in [0, 1]
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)


def report(findings: list[Finding], problems: list[str]) -> dict[str, Any]:
    """The `--json` document: most likely finding first."""
    ordered = sorted(findings, key=lambda finding: -finding.confidence)
    return {
        "schema": SCHEMA,
        "healthy": not ordered,
        "findings": [asdict(finding) for finding in ordered],
        "problems": problems,
    }


def comm_label(comm_id: int) -> str:
    return f"{comm_id:016x}"
