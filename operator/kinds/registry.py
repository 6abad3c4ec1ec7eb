"""The kinds rankwatch knows, most specific first: a JobSet's pods are also pods of an Indexed Job, a
TrainJob's are a JobSet's; the first adapter that claims a pod names its group."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rankwatch.operator.kinds.adapter import Group, KindAdapter
from rankwatch.operator.kinds.indexed_job import INDEXED_JOB
from rankwatch.operator.kinds.jobset import JOBSET
from rankwatch.operator.kinds.pytorchjob import PYTORCHJOB
from rankwatch.operator.kinds.trainjob import TRAINJOB
from rankwatch.operator.kinds.volcano_job import VOLCANO_JOB

ADAPTERS: tuple[KindAdapter, ...] = (TRAINJOB, JOBSET, VOLCANO_JOB, PYTORCHJOB, INDEXED_JOB)


def adapter_for(pod: Mapping[str, Any]) -> tuple[KindAdapter, Group] | None:
    """The adapter that claims ``pod`` and the group it names, None when no kind rankwatch knows owns it."""
    for adapter in ADAPTERS:
        group = adapter.group_of(pod)
        if group is not None:
            return adapter, group
    return None


def adapter_of_kind(key: str) -> KindAdapter | None:
    """The adapter of the kind rankwatch names ``key`` (``Job``, ``JobSet``, ``VolcanoJob``), None for one it does
    not know."""
    return next((adapter for adapter in ADAPTERS if adapter.key == key), None)
