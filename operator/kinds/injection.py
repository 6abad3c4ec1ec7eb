"""Whether and how a pod of another kind gets what a TrainingJob's pods get: pure functions of the pod
as admitted, so every decision is unit-tested; the webhook (``webhook.py``) applies them.

A pod is opted in by its annotation ``rankwatch.io/inject: "true"`` (in its template) unless it says
``rankwatch.io/opt-out: "true"``; the namespace's label ``rankwatch.io/inject=enabled`` is checked by the
API server (the webhook's namespaceSelector), so the webhook is not even called elsewhere. The pod's
group and index come from its kind's adapter; its ranks from torchrun's RANK / LOCAL_RANK / WORLD_SIZE,
read by the library in each process.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rankwatch.operator import api
from rankwatch.operator.config import WorkerPodSettings
from rankwatch.operator.kinds.adapter import Group, KindAdapter
from rankwatch.operator.kinds.group_settings import group_settings
from rankwatch.operator.kinds.registry import adapter_for
from rankwatch.operator.lifecycle.pod_spec import INIT_CONTAINER, PodTracing, inject_tracing
from rankwatch.operator.spec import InvalidSpec

ENABLED = "enabled"


@dataclass(frozen=True)
class Injection:
    adapter: KindAdapter
    group: Group
    target: PodTracing


@dataclass(frozen=True)
class NotInjected:
    reason: str
    asked: bool
    """The pod opted in: the reason is written on it, and its group hears that it is not watched."""


def _annotations(pod: Mapping[str, Any]) -> Mapping[str, str]:
    return pod.get("metadata", {}).get("annotations") or {}


def opted_in(pod: Mapping[str, Any]) -> bool:
    annotations = _annotations(pod)
    return annotations.get(api.INJECT_ANNOTATION) == "true" and annotations.get(api.OPT_OUT_ANNOTATION) != "true"


def is_injected(pod: Mapping[str, Any]) -> bool:
    """Carries the injection (the webhook's, or a TrainingJob's own pod built with tracing on)."""
    if _annotations(pod).get(api.TRACING_ANNOTATION) == ENABLED:
        return True
    return any(c.get("name") == INIT_CONTAINER for c in pod.get("spec", {}).get("initContainers") or [])


def plan(pod: Mapping[str, Any]) -> Injection | NotInjected:
    """What to do with ``pod`` at its creation."""
    if api.JOB_NAME_LABEL in (pod.get("metadata", {}).get("labels") or {}):
        return NotInjected("a TrainingJob's pod: the operator builds it with the injection", False)
    if not opted_in(pod):
        return NotInjected("not opted in", False)
    if is_injected(pod):
        return NotInjected("already injected", False)  # called again (reinvocationPolicy: IfNeeded)
    claimed = adapter_for(pod)
    if claimed is None:
        owners = [
            f"{o.get('apiVersion')}/{o.get('kind')}" for o in pod.get("metadata", {}).get("ownerReferences") or []
        ]
        return NotInjected(
            f"no kind rankwatch supports owns this pod (owners: {', '.join(owners) or 'none'}); "
            "see docs/other-job-kinds.md",
            True,
        )
    adapter, group = claimed
    try:
        settings = group_settings(pod, str(group))
    except InvalidSpec as error:
        return NotInjected(str(error), True)
    index = adapter.index_field()
    if index is None and (index := adapter.index_of(pod)) is None:
        return NotInjected(f"{group}: the pod says no valid index (see docs/other-job-kinds.md)", True)
    target = PodTracing(
        owner=str(group),
        group=group.collector_name,
        namespace=group.namespace,
        replica_index=index,
        nproc_per_node=settings.nproc_per_node,
        tracing=settings.tracing,
        token_secret=adapter.token_secret_name(group.name),
        token_optional=True,  # made at admission; never let a missing Secret keep the pod from starting
    )
    return Injection(adapter, group, target)


def injected_pod(pod: Mapping[str, Any], injection: Injection, config: WorkerPodSettings) -> dict[str, Any]:
    """A copy of ``pod`` with the injection; raises InvalidSpec (naming the group) when the pod uses a
    name rankwatch manages."""
    result = copy.deepcopy(dict(pod))
    inject_tracing(result["spec"], injection.target, config)
    result["metadata"].setdefault("annotations", {})[api.TRACING_ANNOTATION] = ENABLED
    result["metadata"].setdefault("labels", {})[api.TRACED_LABEL] = "true"  # the NetworkPolicies' peer
    return result
