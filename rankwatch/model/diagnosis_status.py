"""What a job keeps of its latest diagnosis: ``status.diagnosis`` on a TrainingJob, the annotation
``rankwatch.io/diagnosis`` (the same record, as JSON) on the owner of a group of another kind.

:class:`DiagnosisStatus` is the only code that reads or writes that record by key: everything else
reads its fields. The record's keys and types are the CRD's (``crds/``: ``status.diagnosis``), which
the API server stores as they are; reading is lenient (a record from an older operator, or an
annotation a job's author edited, reads with defaults for what is missing or malformed, never a
crash).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rankwatch.model.finding import Cause, FindingKind, condition_of

STATUS_KEY = "diagnosis"
RESTART_KEY = "restart"


class FollowUp(enum.StrEnum):
    """What a diagnosis calls for once written, each recorded on the job when done (by its key)."""

    REMEDIATION = "remediation"  # what remediation did (cordoned and tainted, dry run, or why not)
    ALERTED = "alertedTime"  # when the alert was handed to the alert pipeline


@dataclass(frozen=True)
class DiagnosisStatus:
    """One diagnosis as the job records it. ``reason`` is written as ``kind`` (``Hang``,
    ``StuckInCollective``, ``Straggler``...: ``Finding.reason``)."""

    active: bool
    reason: str
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    pods: tuple[str, ...] = ()
    confidence: float = 0.0
    summary: str = ""
    cause: Cause | None = None  # None: a record written before causes existed
    cause_evidence: str = ""
    node_alerts: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    communicator: str | None = None
    time: str = ""  # RFC 3339; identifies the diagnosis (its Event, its report, its follow-ups)
    resolved_time: str | None = None
    suspicion: str = ""
    report: str = ""  # the report ConfigMap's name
    remediation: str | None = None  # FollowUp.REMEDIATION; None while pending
    alerted_time: str | None = None  # FollowUp.ALERTED; None while pending
    restart: str | None = None  # a group of another kind: what its restart lever did (claimed, done, refused)

    # -- reading -------------------------------------------------------------------------------------
    @classmethod
    def from_status(cls, status: Mapping[str, Any] | None) -> DiagnosisStatus | None:
        """The diagnosis in a job's ``status`` (None when it carries none)."""
        return cls.from_record((status or {}).get(STATUS_KEY))

    @classmethod
    def from_record(cls, record: Any) -> DiagnosisStatus | None:
        """The diagnosis in a record (``status.diagnosis``, the parsed annotation); None when it is
        empty or not a mapping."""
        if not isinstance(record, Mapping) or not record:
            return None
        return cls(
            active=record.get("active") is True,
            reason=_text(record.get("kind")),
            ranks=tuple(rank for rank in _list(record.get("ranks")) if _is_int(rank)),
            nodes=_texts(record.get("nodes")),
            pods=_texts(record.get("pods")),
            confidence=_number(record.get("confidence")),
            summary=_text(record.get("summary")),
            cause=_cause(record.get("cause")),
            cause_evidence=_text(record.get("causeEvidence")),
            node_alerts=_texts(record.get("nodeAlerts")),
            problems=_texts(record.get("problems")),
            communicator=_optional_text(record.get("communicator")),
            time=_text(record.get("time")),
            resolved_time=_optional_text(record.get("resolvedTime")),
            suspicion=_text(record.get("suspicion")),
            report=_text(record.get("report")),
            remediation=_optional_text(record.get(FollowUp.REMEDIATION)),
            alerted_time=_optional_text(record.get(FollowUp.ALERTED)),
            restart=_optional_text(record.get(RESTART_KEY)),
        )

    # -- writing -------------------------------------------------------------------------------------
    def to_record(self) -> dict[str, Any]:
        """The record, key by key as the CRD names them. None is unset (a status merge patch removes
        the key): so are an empty ``kind`` and ``time``, which the CRD's enum and date-time format
        would refuse as empty strings."""
        record = {
            "active": self.active,
            "kind": self.reason or None,
            "ranks": list(self.ranks),
            "nodes": list(self.nodes),
            "pods": list(self.pods),
            "confidence": self.confidence,
            "summary": self.summary,
            "cause": self.cause.value if self.cause is not None else None,
            "causeEvidence": self.cause_evidence,
            "nodeAlerts": list(self.node_alerts),
            "problems": list(self.problems),
            "communicator": self.communicator,
            "time": self.time or None,
            "resolvedTime": self.resolved_time,
            "suspicion": self.suspicion,
            "report": self.report,
            FollowUp.REMEDIATION.value: self.remediation,
            FollowUp.ALERTED.value: self.alerted_time,
        }
        if self.restart is not None:  # only on the annotation of another kind's owner: not a CRD field
            record[RESTART_KEY] = self.restart
        return record

    def stored(self) -> dict[str, Any]:
        """The record as the API server keeps it once written (a merge patch leaves unset keys out)."""
        return {key: value for key, value in self.to_record().items() if value is not None}

    def to_status(self) -> dict[str, Any]:
        """The status fields that write it (``{"diagnosis": record}``)."""
        return {STATUS_KEY: self.to_record()}

    # -- what it says ----------------------------------------------------------------------------------
    @property
    def kind(self) -> FindingKind | None:
        """The finding kind behind ``reason`` (None when it is not one of ours)."""
        return FindingKind.from_reason(self.reason)

    @property
    def condition(self) -> str | None:
        """``Hung`` or ``Degraded``: the condition its reason sets (None when not one of ours)."""
        return condition_of(self.reason)

    @property
    def active_condition(self) -> str | None:
        """The condition it holds True now: its condition while active, else None."""
        return self.condition if self.active else None

    @property
    def key(self) -> str:
        """Identifies one finding on the job (time, kind, culprits), for ``status.handledDiagnosis``."""
        return f"{self.time}/{self.reason}/{','.join(str(rank) for rank in self.ranks)}"

    def pending(self, alerting: bool) -> list[FollowUp]:
        """The follow-ups an active diagnosis still calls for (the alert only with ``alerting``)."""
        if not self.active or not self.time:
            return []
        pending = [FollowUp.REMEDIATION] if not self.remediation else []
        return pending + ([FollowUp.ALERTED] if alerting and not self.alerted_time else [])

    def follow_up_done(self, follow_up: FollowUp) -> bool:
        return bool(self.remediation if follow_up is FollowUp.REMEDIATION else self.alerted_time)

    # -- changes ---------------------------------------------------------------------------------------
    def with_follow_up(self, follow_up: FollowUp, value: str) -> DiagnosisStatus:
        field = "remediation" if follow_up is FollowUp.REMEDIATION else "alerted_time"
        return dataclasses.replace(self, **{field: value})

    def with_restart(self, outcome: str) -> DiagnosisStatus:
        return dataclasses.replace(self, restart=outcome)

    def inactive(self) -> DiagnosisStatus:
        return dataclasses.replace(self, active=False)

    def resolved(self, moment: str) -> DiagnosisStatus:
        """Inactive since ``moment`` (the job recovered, or its attempt ended)."""
        return dataclasses.replace(self, active=False, resolved_time=moment)


def key_of(diagnosis: DiagnosisStatus | None) -> str:
    """``diagnosis.key``, and the key of no diagnosis (``//``)."""
    return diagnosis.key if diagnosis is not None else "//"


def _list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else []


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _cause(value: Any) -> Cause | None:
    """None when unset (a record from before causes); a cause this version does not know reads as unknown."""
    if not value:
        return None
    return Cause(value) if value in {cause.value for cause in Cause} else Cause.UNKNOWN


def _text(value: Any) -> str:
    return value if isinstance(value, str) else "" if value is None else str(value)


def _optional_text(value: Any) -> str | None:
    return None if value is None else _text(value)


def _texts(value: Any) -> tuple[str, ...]:
    return tuple(_text(item) for item in _list(value))


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0
