"""A finding: what the analysis blames (kind, ranks, nodes, communicator), how sure it is, why (the
cause) and the numbers behind it (the evidence).

:class:`FindingKind` is the one vocabulary of kinds: the analysis's own name (``hang``; the JSON and
node annotations), the reason written on the TrainingJob and its Events (``Hang``), the condition it
sets (``Hung`` / ``Degraded``), the alert name (``TrainingJobHang``) and the ``spec.alerting.levels``
key that levels it (``hang``). A hang whose members all sit inside one collective keeps kind
``hang`` and reads ``StuckInCollective`` on the job (:attr:`Finding.reason`).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from rankwatch.model.evidence import STUCK

STUCK_IN_COLLECTIVE = "StuckInCollective"
HUNG, DEGRADED = "Hung", "Degraded"


class FindingKind(enum.StrEnum):
    """Finding kinds, most severe first (a queue of diagnoses serves a hang before a straggler)."""

    HANG = "hang"
    STRAGGLER = "straggler"
    SLOW_LINK = "slow_link"
    FAIL_SLOW = "fail_slow"
    MISMATCH = "mismatch"  # ranks called different collectives: software, never a node's fault

    @property
    def reason(self) -> str:
        """How the job's status, condition reason and Events name it."""
        return _PRESENTATION[self][0]

    @property
    def condition(self) -> str:
        """The TrainingJob condition it sets True."""
        return HUNG if self is FindingKind.HANG else DEGRADED

    @property
    def alert_name(self) -> str:
        return _PRESENTATION[self][1]

    @property
    def level_key(self) -> str:
        """The ``spec.alerting.levels`` field that sets its alert level."""
        return _PRESENTATION[self][2]

    @property
    def default_level(self) -> str:
        """Its alert level (P0..P3) when ``spec.alerting.levels`` does not set one (the CRD's default)."""
        return _PRESENTATION[self][3]

    @property
    def severity(self) -> int:
        """0 is the most severe."""
        return list(FindingKind).index(self)

    @classmethod
    def from_reason(cls, reason: str) -> FindingKind | None:
        """The kind behind a reason read from a job's status (None when it is not one of ours)."""
        if reason == STUCK_IN_COLLECTIVE:
            return cls.HANG
        return next((kind for kind in cls if kind.reason == reason), None)


class Cause(enum.StrEnum):
    """Why a finding happened (decided by ``rankwatch.analysis.cause``, which says how)."""

    COMPUTE = "compute"
    COMMUNICATION = "communication"
    HOST = "host"
    DATA_STORAGE = "data/storage"
    SOFTWARE = "software"  # the job's own code (mismatched collectives): page its owner, cordon nothing
    UNKNOWN = "unknown"


_PRESENTATION = {
    # kind: (reason on the job, alert name, spec.alerting.levels key, default level)
    FindingKind.HANG: ("Hang", "TrainingJobHang", "hang", "P0"),
    FindingKind.STRAGGLER: ("Straggler", "TrainingJobStraggler", "straggler", "P1"),
    FindingKind.SLOW_LINK: ("SlowLink", "TrainingJobSlowLink", "slowLink", "P1"),
    FindingKind.FAIL_SLOW: ("FailSlow", "TrainingJobFailSlow", "degradation", "P2"),
    # mismatched collectives: the job is stuck in its own code; its owner is paged
    FindingKind.MISMATCH: ("CollectiveMismatch", "TrainingJobCollectiveMismatch", "mismatch", "P0"),
}


def condition_of(reason: str | None) -> str | None:
    """The condition (``Hung`` / ``Degraded``) a reason read from a job sets, None when not one of ours."""
    kind = FindingKind.from_reason(reason or "")
    return kind.condition if kind else None


@dataclass(frozen=True)
class Finding:
    kind: FindingKind  # given as the enum or its value ("hang", ...)
    ranks: list[int]
    nodes: list[str]
    communicator: str | None
    confidence: float  # in [0, 1]
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    """The detector's numbers; the keys more than one module reads are named in ``rankwatch.model.evidence``."""
    cause: Cause = Cause.UNKNOWN  # given as the enum or its value
    cause_evidence: str = ""  # the figures that decided the cause (or what was missing to decide one)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FindingKind(self.kind))
        object.__setattr__(self, "cause", Cause(self.cause))

    @property
    def cause_text(self) -> str:
        """``cause host: <evidence>``, as the Event, the alert and ``rankwatch analyze`` show it."""
        return f"cause {self.cause.value}" + (f": {self.cause_evidence}" if self.cause_evidence else "")

    @property
    def reason(self) -> str:
        """The reason on the job: the kind's, or ``StuckInCollective`` for a hang inside one collective."""
        if self.kind is FindingKind.HANG and self.evidence.get(STUCK):
            return STUCK_IN_COLLECTIVE
        return self.kind.reason

    @property
    def condition(self) -> str:
        return self.kind.condition

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "kind": self.kind.value, "cause": self.cause.value}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Finding:
        """A finding from ``to_json``; reports written before causes existed read as cause ``unknown``."""
        return cls(
            kind=FindingKind(data["kind"]),
            ranks=[int(rank) for rank in data["ranks"]],
            nodes=[str(node) for node in data["nodes"]],
            communicator=data.get("communicator"),
            confidence=float(data["confidence"]),
            summary=str(data["summary"]),
            evidence=dict(data.get("evidence") or {}),
            cause=Cause(data.get("cause") or Cause.UNKNOWN),
            cause_evidence=str(data.get("cause_evidence") or ""),
        )
