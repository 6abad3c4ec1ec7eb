"""The TrainingJob spec as a typed structure.

The API server applies the CRD's defaults before the operator sees an object; the defaults here
repeat them only so that code and tests can build a spec without a server, and a unit test keeps
the two in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rankwatch.analysis.findings import FindingKind


class InvalidSpec(ValueError):
    """The spec cannot be turned into workers; the message names the field."""


@dataclass(frozen=True)
class Parallelism:
    tensor: int = 1
    pipeline: int = 1
    data: int | None = None


@dataclass(frozen=True)
class Tracing:
    enabled: bool = True
    sensitivitySeconds: int = 300
    windowSeconds: int = 5
    gpuTiming: bool = False
    flightRecorder: bool = True


@dataclass(frozen=True)
class Remediation:
    cordon: bool = True
    dryRun: bool = False
    maxNodesPerJob: int = 2


@dataclass(frozen=True)
class AlertLevels:
    """Alert level (P0..P3) per finding kind; keys are the CRD's spelling of the kinds."""

    hang: str = "P0"
    straggler: str = "P1"
    slowLink: str = "P1"
    degradation: str = "P2"

    def for_finding(self, kind: FindingKind) -> str:
        """The level of a finding kind (its ``level_key`` names the field)."""
        try:
            return getattr(self, FindingKind(kind).level_key)
        except ValueError:
            raise InvalidSpec(f"spec.alerting.levels: no level for finding kind {kind!r}") from None


@dataclass(frozen=True)
class Alerting:
    route: str = "default"
    """Copied onto the job's alerts as label ``route``: routing config matchers pick the receivers."""
    levels: AlertLevels = field(default_factory=AlertLevels)


@dataclass(frozen=True)
class TrainingJobSpec:
    template: dict[str, Any]
    replicas: int = 1
    nprocPerNode: int = 8
    masterPort: int = 29500
    parallelism: Parallelism = field(default_factory=Parallelism)
    tracing: Tracing = field(default_factory=Tracing)
    remediation: Remediation = field(default_factory=Remediation)
    alerting: Alerting = field(default_factory=Alerting)

    @property
    def world_size(self) -> int:
        return self.replicas * self.nprocPerNode

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.parallelism.tensor * self.parallelism.pipeline)

    @classmethod
    def from_manifest(cls, spec: dict[str, Any]) -> TrainingJobSpec:
        """Parse ``spec`` (as stored, defaults applied); unknown keys are refused, not ignored."""
        try:
            return cls(
                template=spec["template"],
                replicas=spec.get("replicas", 1),
                nprocPerNode=spec.get("nprocPerNode", 8),
                masterPort=spec.get("masterPort", 29500),
                parallelism=Parallelism(**spec.get("parallelism", {})),
                tracing=Tracing(**spec.get("tracing", {})),
                remediation=Remediation(**spec.get("remediation", {})),
                alerting=_alerting(spec.get("alerting", {})),
            )
        except KeyError as error:
            raise InvalidSpec(f"spec.{error.args[0]} is required") from error
        except TypeError as error:  # an unexpected keyword names the unknown field
            raise InvalidSpec(f"spec: {error}") from error


def _alerting(alerting: dict[str, Any]) -> Alerting:
    alerting = dict(alerting)
    levels = alerting.pop("levels", {})
    try:
        return Alerting(levels=AlertLevels(**levels), **alerting)
    except TypeError as error:
        raise InvalidSpec(f"spec.alerting: {error}") from error
