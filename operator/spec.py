"""The TrainingJob spec as a typed structure.

The API server applies the CRD's defaults before the operator sees an object; the defaults here
repeat them only so that code and tests can build a spec without a server, and a unit test keeps
the two in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rankwatch.model.finding import FindingKind


class InvalidSpec(ValueError):
    """The spec cannot be turned into workers; the message names the field."""


@dataclass(frozen=True)
class Parallelism:
    tensor: int = 1
    pipeline: int = 1
    data: int | None = None


@dataclass(frozen=True)
class S3Archive:
    """An S3-compatible bucket; credentials come from the Secret ``secretRef`` (keys
    ``accessKeyId`` / ``secretAccessKey``, optional ``sessionToken``) in the job's namespace."""

    bucket: str
    secretRef: str
    endpoint: str | None = None
    """Base URL of an S3-compatible server (MinIO, Ceph RGW, ...); unset: AWS S3."""
    region: str = "us-east-1"
    prefix: str = "rankwatch"
    """Key prefix, one path segment (``archive.check_target``); each attempt goes to
    ``<prefix>/<namespace>/<job>/<job uid>/attempt-<n>/``, so a job writes only below its own namespace and name."""


@dataclass(frozen=True)
class Archive:
    s3: S3Archive | None = None


@dataclass(frozen=True)
class Tracing:
    enabled: bool = True
    sensitivitySeconds: int = 300
    windowSeconds: int = 5
    gpuTiming: bool = True
    flightRecorder: bool = True
    archive: Archive | None = None
    """Where an attempt's evidence is kept once its pods are gone; unset: not kept."""
    imagePullSecrets: tuple[str, ...] = ()
    """Secrets (names, in the job's namespace) for pulling rankwatch's image into the init container
    and the sidecar; added to the worker pods' imagePullSecrets."""


@dataclass(frozen=True)
class Sidecar:
    ptrace: bool = False
    """A privilege the job asks for: SYS_PTRACE (as root, no other capability) on the sidecar, so py-spy
    reads the trainer's Python stacks and profiles; refused where the operator's admin disallows it."""


@dataclass(frozen=True)
class Remediation:
    cordon: bool = True
    dryRun: bool = False
    maxNodesPerJob: int = 2


@dataclass(frozen=True)
class RestartOn:
    """Which findings end an attempt and start the next one."""

    hang: bool = True
    """A confirmed hang (Hang, StuckInCollective)."""
    slowdownAbove: float | None = None
    """A straggler or fail-slow finding whose measured slowdown is at least this fraction (0.5: 50%
    slower); unset: a slowdown only cordons."""
    workerFailure: bool = False
    """A worker pod that failed (exit code != 0, or lost) restarts the job instead of failing it."""


@dataclass(frozen=True)
class Recovery:
    policy: str = "RestartAwayFromSuspects"
    """``RestartAwayFromSuspects`` or ``None`` (diagnose, cordon, archive; never end an attempt)."""
    maxRestarts: int = 3
    backoffSeconds: int = 10
    """Between ending an attempt and creating the next one's workers."""
    abortHungAfterSeconds: int = 0
    """How long a confirmed hang may keep its GPUs (e.g. for a person to look at it) before the attempt
    is ended."""
    restartOn: RestartOn = field(default_factory=RestartOn)

    @property
    def restarts(self) -> bool:
        return self.policy == "RestartAwayFromSuspects"


@dataclass(frozen=True)
class AlertLevels:
    """Alert level (P0..P3) per finding kind; keys are the CRD's spelling of the kinds."""

    hang: str = FindingKind.HANG.default_level
    straggler: str = FindingKind.STRAGGLER.default_level
    slowLink: str = FindingKind.SLOW_LINK.default_level
    degradation: str = FindingKind.FAIL_SLOW.default_level
    mismatch: str = FindingKind.MISMATCH.default_level

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
    suspend: bool = False
    """No worker pods while true (a running job's are deleted); Kueue-style suspension."""
    parallelism: Parallelism = field(default_factory=Parallelism)
    tracing: Tracing = field(default_factory=Tracing)
    sidecar: Sidecar = field(default_factory=Sidecar)
    remediation: Remediation = field(default_factory=Remediation)
    alerting: Alerting = field(default_factory=Alerting)
    recovery: Recovery = field(default_factory=Recovery)

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
                suspend=bool(spec.get("suspend", False)),
                parallelism=Parallelism(**spec.get("parallelism", {})),
                tracing=_tracing(spec.get("tracing", {})),
                sidecar=_sidecar(spec.get("sidecar", {})),
                remediation=Remediation(**spec.get("remediation", {})),
                alerting=_alerting(spec.get("alerting", {})),
                recovery=_recovery(spec.get("recovery", {})),
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


def _sidecar(sidecar: dict[str, Any]) -> Sidecar:
    try:
        return Sidecar(**sidecar)
    except TypeError as error:
        raise InvalidSpec(f"spec.sidecar: {error}") from error


def _tracing(tracing: dict[str, Any]) -> Tracing:
    tracing = dict(tracing)
    archive = tracing.pop("archive", None)
    pull_secrets = tuple(reference.get("name", "") for reference in tracing.pop("imagePullSecrets", None) or [])
    try:
        if archive is not None:
            archive = dict(archive)
            s3 = archive.pop("s3", None)
            archive = Archive(s3=S3Archive(**_secret_ref(s3)) if s3 is not None else None, **archive)
            if archive.s3 is None:
                raise InvalidSpec("spec.tracing.archive: name where to keep the evidence (s3)")
        return Tracing(archive=archive, imagePullSecrets=pull_secrets, **tracing)
    except TypeError as error:
        raise InvalidSpec(f"spec.tracing: {error}") from error


def _secret_ref(s3: dict[str, Any]) -> dict[str, Any]:
    """``secretRef: {name: x}`` as stored -> the Secret's name."""
    s3 = dict(s3)
    reference = s3.get("secretRef")
    if isinstance(reference, dict):
        s3["secretRef"] = reference.get("name")
    if not s3.get("secretRef"):
        raise InvalidSpec("spec.tracing.archive.s3.secretRef.name is required (the Secret holding the credentials)")
    return s3


def _recovery(recovery: dict[str, Any]) -> Recovery:
    recovery = dict(recovery)
    restart_on = recovery.pop("restartOn", {})
    try:
        return Recovery(restartOn=RestartOn(**restart_on), **recovery)
    except TypeError as error:
        raise InvalidSpec(f"spec.recovery: {error}") from error
