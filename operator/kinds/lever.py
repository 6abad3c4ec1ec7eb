"""What a restart lever is: one kind's way to restart its whole group away from the suspects
(``restart.py`` decides when; ``restart_<kind>.py`` pull them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import kubernetes

from rankwatch.model.diagnosis_status import DiagnosisStatus
from rankwatch.operator.kinds.adapter import Group
from rankwatch.operator.spec import TrainingJobSpec


class LeverRefused(Exception):
    """The lever cannot be pulled now (the owner changed under it); the message says why."""


@dataclass(frozen=True)
class Pulled:
    """What a lever did (one line, for the record and the Event), and the ended attempt's pods whose
    late summaries the next attempt ignores (empty where the kind reuses pod names)."""

    done: str
    ended_pods: frozenset[str]


class RestartLever(Protocol):
    """One kind's way to restart its whole group. Blocking calls: run in a thread."""

    def refusal(
        self, kube: kubernetes.client.ApiClient, owner: Mapping[str, Any], diagnosis: DiagnosisStatus,
        pods: list[dict[str, Any]], spec: TrainingJobSpec,
    ) -> str | None:  # fmt: skip
        """Why the group cannot be restarted this way now (cordon and page only), None when it can."""

    def pull(
        self, kube: kubernetes.client.ApiClient, group: Group, owner: Mapping[str, Any],
        diagnosis: DiagnosisStatus, pods: list[dict[str, Any]], spec: TrainingJobSpec,
    ) -> Pulled:  # fmt: skip
        """Restart the group; raises LeverRefused or ApiException when it could not."""
