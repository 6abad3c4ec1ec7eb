"""What a pod of another kind may say of its group, read from its annotations (its template's, so alike
on every pod of the group): the TrainingJob ``spec`` fields that have a meaning for a job rankwatch
does not own. The job's author writes them: every value is checked, and a bad one is refused with a
message naming the annotation, never guessed at.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rankwatch.operator import api
from rankwatch.operator.spec import InvalidSpec, Parallelism, Recovery, Remediation, Tracing, TrainingJobSpec

REMEDIATIONS = {"cordon": Remediation(), "dry-run": Remediation(dryRun=True), "off": Remediation(cordon=False)}
MAX_SECONDS = 86_400
RECOVERY_ANNOTATION = "rankwatch.io/recovery"
"""On a pod, optional: ``RestartAwayFromSuspects`` (the default) or ``None``, as ``spec.recovery.policy``."""
MAX_RESTARTS_ANNOTATION = "rankwatch.io/max-restarts"
"""On a pod, optional: as ``spec.recovery.maxRestarts``, for a kind with no limit of its own (an Indexed Job)."""
RECOVERY_POLICIES = ("RestartAwayFromSuspects", "None")


@dataclass(frozen=True)
class GroupSettings:
    nproc_per_node: int
    """Ranks per pod; 0 when the pod does not say."""
    tracing: Tracing
    parallelism: Parallelism
    remediation: Remediation
    recovery: Recovery = field(default_factory=Recovery)

    def spec(self, replicas: int) -> TrainingJobSpec:
        """The group as the monitor follows a TrainingJob (``replicas`` pods)."""
        return TrainingJobSpec(
            template={},
            replicas=replicas,
            nprocPerNode=self.nproc_per_node,
            parallelism=self.parallelism,
            tracing=self.tracing,
            remediation=self.remediation,
            recovery=self.recovery,
        )


def _whole(annotations: Mapping[str, str], key: str, owner: str, default: int, low: int, high: int) -> int:
    value = annotations.get(key)
    if value is None:
        return default
    if not value.isdigit() or not low <= int(value) <= high:
        raise InvalidSpec(f"{owner}: annotation {key}={value[:40]!r} is not a whole number from {low} to {high}")
    return int(value)


def group_settings(pod: Mapping[str, Any], owner: str) -> GroupSettings:
    """The settings ``pod``'s annotations give; raises InvalidSpec naming ``owner`` and the annotation."""
    annotations = pod.get("metadata", {}).get("annotations") or {}
    defaults = Tracing()
    sensitivity = _whole(annotations, api.SENSITIVITY_ANNOTATION, owner, defaults.sensitivitySeconds, 1, MAX_SECONDS)
    window = _whole(annotations, api.WINDOW_ANNOTATION, owner, defaults.windowSeconds, 1, 3600)
    remediation = annotations.get(api.REMEDIATION_ANNOTATION, "cordon")
    if remediation not in REMEDIATIONS:
        raise InvalidSpec(
            f"{owner}: annotation {api.REMEDIATION_ANNOTATION}={remediation[:40]!r} is not one of "
            f"{', '.join(REMEDIATIONS)}"
        )
    policy = annotations.get(RECOVERY_ANNOTATION, RECOVERY_POLICIES[0])
    if policy not in RECOVERY_POLICIES:
        raise InvalidSpec(
            f"{owner}: annotation {RECOVERY_ANNOTATION}={policy[:40]!r} is not one of {', '.join(RECOVERY_POLICIES)}"
        )
    max_restarts = _whole(annotations, MAX_RESTARTS_ANNOTATION, owner, Recovery().maxRestarts, 0, 100)
    return GroupSettings(
        nproc_per_node=_whole(annotations, api.NPROC_ANNOTATION, owner, 0, 1, 1024),
        tracing=Tracing(sensitivitySeconds=sensitivity, windowSeconds=window),
        parallelism=Parallelism(
            tensor=_whole(annotations, api.TENSOR_ANNOTATION, owner, 1, 1, 65_536),
            pipeline=_whole(annotations, api.PIPELINE_ANNOTATION, owner, 1, 1, 65_536),
        ),
        remediation=REMEDIATIONS[remediation],
        recovery=Recovery(policy=policy, maxRestarts=max_restarts),
    )
