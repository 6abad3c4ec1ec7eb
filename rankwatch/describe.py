"""`rankwatch describe <kind>/<name>`: what rankwatch found about one job, whatever its kind, as
`kubectl describe trainingjob` shows it for a TrainingJob: health, suspects, the diagnosis (what, who,
where, how sure, what was done about it, where the full report is) and the Events on the object.

A TrainingJob keeps its diagnosis in ``status.diagnosis``; a job of another kind (an Indexed Job, a
JobSet...) in the annotation ``rankwatch.io/diagnosis`` of the object owning its pods
(``rankwatch.operator.kinds.group_record``). Reading only: the same RBAC as `kubectl describe`.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch.model.diagnosis_status import DiagnosisStatus
from rankwatch.operator import api
from rankwatch.operator.kinds import group_record
from rankwatch.operator.kinds.adapter import KindAdapter
from rankwatch.operator.kinds.registry import ADAPTERS


class DescribeError(ValueError):
    """The request cannot be answered; the message says why and what to type instead."""


@dataclass(frozen=True)
class KindRef:
    kind: str
    """As rankwatch names it (``VolcanoJob`` for Volcano's Job)."""
    api_version: str
    plural: str
    names: tuple[str, ...]
    """What a person may type for it: its name, and its plural unless it shares that (Volcano's ``jobs``)."""


def _kind_ref(adapter: KindAdapter) -> KindRef:
    names = (adapter.key.lower(), adapter.plural) if adapter.key == adapter.kind else (adapter.key.lower(),)
    return KindRef(adapter.key, adapter.api_version, adapter.plural, names)


TRAININGJOB = KindRef(api.KIND, api.API_VERSION, api.PLURAL, (api.KIND.lower(), api.PLURAL))
KINDS = (TRAININGJOB, *(_kind_ref(adapter) for adapter in ADAPTERS))
SHORT_NAMES = {"tj": api.KIND, "js": "JobSet", "vcjob": "VolcanoJob", "vj": "VolcanoJob"}


def kind_named(text: str) -> KindRef:
    """The kind ``text`` names, as kubectl takes it: the kind, its plural or short name, any case."""
    wanted = SHORT_NAMES.get(text.lower(), text).lower()
    for kind in KINDS:
        if wanted in kind.names:
            return kind
    raise DescribeError(f"unknown kind {text!r}; rankwatch describes {', '.join(k.kind for k in KINDS)}")


def parse_reference(reference: str) -> tuple[KindRef, str]:
    kind, slash, name = reference.partition("/")
    if not slash or not kind or not name or "/" in name:
        raise DescribeError(f"{reference!r}: expected KIND/NAME, as in trainingjob/llama or jobset/bert")
    return kind_named(kind), name


def read(kube: kubernetes.client.ApiClient, kind: KindRef, namespace: str, name: str) -> tuple[dict, list]:
    """The object and the Events about it (oldest first). Raises DescribeError when it does not exist."""
    api_group, _, version = kind.api_version.rpartition("/")
    try:
        found = kubernetes.client.CustomObjectsApi(kube).get_namespaced_custom_object(
            api_group, version, namespace, kind.plural, name
        )
    except ApiException as error:
        if error.status == 404:
            raise DescribeError(f"{kind.kind} {namespace}/{name} not found") from None
        raise
    events = kubernetes.client.CoreV1Api(kube).list_namespaced_event(
        namespace, field_selector=f"involvedObject.uid={found['metadata']['uid']}"
    )
    items = [kube.sanitize_for_serialization(event) for event in events.items]
    return found, sorted(items, key=_event_time)


def _event_time(event: Mapping[str, Any]) -> str:
    return str(event.get("lastTimestamp") or event.get("eventTime") or event["metadata"].get("creationTimestamp") or "")


def _age(stamp: str, now: datetime.datetime) -> str:
    try:
        then = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return "<unknown>"
    seconds = max(0, int((now - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def render(kind: KindRef, found: Mapping[str, Any], events: list[Mapping[str, Any]], now: datetime.datetime) -> str:
    """The description, as text for a person."""
    metadata = found["metadata"]
    annotations = metadata.get("annotations") or {}
    if kind is TRAININGJOB:
        status = found.get("status") or {}
        diagnosis = DiagnosisStatus.from_status(status)
        health, step = status.get("health"), status.get("stepTime")
        suspects = status.get("suspects")
    else:
        diagnosis = group_record.diagnosis_of(dict(found))
        health, step = (
            annotations.get(group_record.HEALTH_ANNOTATION),
            annotations.get(group_record.STEP_TIME_ANNOTATION),
        )
        suspects = annotations.get("rankwatch.io/suspect-nodes")
    lines = [
        f"Name:         {metadata['name']}",
        f"Namespace:    {metadata['namespace']}",
        f"Kind:         {kind.kind} ({kind.api_version})",
        f"Health:       {health or 'Unknown (rankwatch has written nothing on it yet)'}",
        f"Suspects:     {suspects or '<none>'}",
        f"Step time:    {step or '<unknown>'}",
    ]
    if kind is not TRAININGJOB and annotations.get(api.UNWATCHED_ANNOTATION):
        lines.append(f"Unwatched:    {annotations[api.UNWATCHED_ANNOTATION]} pod(s) run without rankwatch's injection")
    if diagnosis:
        lines.append("Diagnosis:")
        fields = (
            ("Kind", diagnosis.reason),
            ("Active", str(diagnosis.active).lower()),
            ("Summary", diagnosis.summary),
            ("Ranks", ",".join(map(str, diagnosis.ranks)) or None),
            ("Nodes", ",".join(diagnosis.nodes) or None),
            ("Pods", ",".join(diagnosis.pods) or None),
            ("Confidence", f"{diagnosis.confidence:.2f}"),
            ("Cause", diagnosis.cause and f"{diagnosis.cause.value}: {diagnosis.cause_evidence}"),
            ("Time", diagnosis.time),
            ("Resolved", diagnosis.resolved_time),
            ("Remediation", diagnosis.remediation or "pending"),
            ("Alerted", diagnosis.alerted_time or "no"),
            ("Restart", diagnosis.restart),  # a group of another kind: its lever's outcome
        )
        lines += [f"  {label + ':':<13}{value}" for label, value in fields if value]
        if diagnosis.report:
            lines.append(
                f"  {'Report:':<13}kubectl get configmap -n {metadata['namespace']} {diagnosis.report} "
                "-o jsonpath='{.data.report\\.txt}'"
            )
    else:
        lines.append("Diagnosis:    <none>")
    lines.append("Events:")
    if not events:
        lines.append("  <none>")
    else:
        rows = [("Type", "Reason", "Age", "From", "Message")]
        for event in events:
            source = event.get("reportingComponent") or (event.get("source") or {}).get("component") or ""
            rows.append((event.get("type", ""), event.get("reason", ""), _age(_event_time(event), now), source,
                         " ".join(str(event.get("message", "")).split())))  # fmt: skip
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines += ["  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4]
                  for row in rows]  # fmt: skip
    return "\n".join(lines)


def describe(kube: kubernetes.client.ApiClient, namespace: str, reference: str) -> str:
    kind, name = parse_reference(reference)
    found, events = read(kube, kind, namespace, name)
    return render(kind, found, events, datetime.datetime.now(datetime.UTC))
