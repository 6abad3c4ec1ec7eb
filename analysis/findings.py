"""What an analysis reports: its findings (``rankwatch.model.finding``, the model every stage passes
on, named here too for the analysis's own modules), what it could not read, whether it can conclude.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from rankwatch.model.finding import Cause, Finding, FindingKind

__all__ = ["SCHEMA", "AnalysisReport", "Cause", "Finding", "FindingKind", "comm_label", "ranked", "utc_text"]

SCHEMA = 1


@dataclass(frozen=True)
class AnalysisReport:
    """What an analysis found: findings most likely first, and what could not be read or judged."""

    findings: list[Finding]
    problems: list[str]
    inconclusive: str = ""
    """Why the input cannot support a verdict (nothing or only part of it read; ``completeness.py``), '' if it can."""

    @property
    def healthy(self) -> bool:
        """No finding in an input read whole: a partial read is never called healthy."""
        return not self.findings and not self.inconclusive

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document (schema 1; ``inconclusive`` and its reason added later, absent means false)."""
        document = {
            "schema": SCHEMA,
            "healthy": self.healthy,
            "inconclusive": bool(self.inconclusive),
            "findings": [finding.to_json() for finding in self.findings],
            "problems": list(self.problems),
        }
        if self.inconclusive:
            document["inconclusive_reason"] = self.inconclusive
        return document

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> AnalysisReport:
        if document.get("schema") != SCHEMA:
            raise ValueError(f"analysis report schema {document.get('schema')!r}; this rankwatch reads {SCHEMA}")
        findings = [Finding.from_json(f) for f in document["findings"]]
        return cls(findings, [str(p) for p in document["problems"]], str(document.get("inconclusive_reason") or ""))


def ranked(findings: list[Finding], problems: list[str]) -> AnalysisReport:
    """The report of ``findings``, most likely first."""
    return AnalysisReport(sorted(findings, key=lambda finding: -finding.confidence), problems)


def utc_text(ns: int) -> str:
    """A trace time (CLOCK_REALTIME ns) as ``2026-11-28 10:35:36.123 UTC``: fixed, unlike "N s ago",
    so a report pasted into a ticket reads the same tomorrow."""
    moment = datetime.datetime.fromtimestamp(ns / 1e9, datetime.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{moment.microsecond // 1000:03d} UTC"


def comm_label(comm_id: int) -> str:
    return f"{comm_id:016x}"
