"""What rankwatch writes on a Node it takes out of scheduling, and how to read it back.

The node's own annotations are the only record of what rankwatch did: a restarted operator, a
second replica and the `rankwatch uncordon` CLI all derive the state from them, so nothing is
kept in memory that a restart could lose. Everything here is pure (no API calls).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rankwatch import tenant_text

PREFIX = "rankwatch.io/"
CORDONED_BY = PREFIX + "cordoned-by"
"""``rankwatch`` when rankwatch really cordoned and/or tainted the node (absent in a dry run)."""
DRY_RUN = PREFIX + "dry-run"
"""``"true"`` when a dry run only annotated the node: nothing about its scheduling changed."""
REASON = PREFIX + "cordon-reason"
JOB = PREFIX + "cordon-job"
"""``<namespace>/<name>`` of the job whose diagnosis named the node."""
JOB_UID = PREFIX + "cordon-job-uid"
TIME = PREFIX + "cordon-time"
"""RFC 3339 with microseconds: orders cordons for the circuit breaker."""
EVIDENCE = PREFIX + "cordon-evidence"
DIAGNOSIS = PREFIX + "cordon-diagnosis"
"""The identity of the diagnosis that asked for the mark (its time): a repeat of the same request (its
first answer lost) knows the mark for its own and finishes it, Events included, instead of skipping."""
WAS_UNSCHEDULABLE = PREFIX + "was-unschedulable"
"""``"true"`` when the node was already cordoned (by someone else) before rankwatch: undo leaves it so."""
EXPIRES = PREFIX + "cordon-expires-at"
"""RFC 3339: when rankwatch undoes the cordon by itself. Set when pods of other namespaces ran on the
node (or rankwatch could not tell): one team's diagnosis must not hold another team's node for good."""
MARK_ANNOTATIONS = (
    CORDONED_BY,
    DRY_RUN,
    REASON,
    JOB,
    JOB_UID,
    TIME,
    EVIDENCE,
    DIAGNOSIS,
    WAS_UNSCHEDULABLE,
    EXPIRES,
)

UNCORDON_REQUEST = PREFIX + "uncordon"
"""Set to ``"true"`` by a person: the operator undoes rankwatch's cordon and removes this annotation."""
UNCORDONED_AT = PREFIX + "uncordoned-at"
"""Kept after an undo: the per-node cooldown keeps rankwatch from re-cordoning at once."""

TAINT_KEY = PREFIX + "suspect"
TAINT_EFFECT = "NoSchedule"
"""NoSchedule, not NoExecute: the running job keeps its pods; its next restart lands elsewhere."""
OPT_OUT_LABEL = PREFIX + "remediation"
OPT_OUT_VALUE = "disabled"
CORDONED_BY_VALUE = "rankwatch"

EVIDENCE_MAX_CHARS = 1024
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def format_time(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def parse_time(text: str | None) -> datetime.datetime | None:
    """None for a missing or unreadable time (a hand-edited annotation must not crash the operator)."""
    if not text:
        return None
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=datetime.UTC)


_UNREADABLE = datetime.datetime.min.replace(tzinfo=datetime.UTC)


def taint_value(namespace: str, name: str) -> str:
    """The job as a taint value (a label value: at most 63 characters).

    ``<namespace>.<name>`` when it fits, so two jobs of the same name in different namespaces
    stay apart; otherwise the name cut short plus a hash of both. Only for people reading
    ``kubectl describe node``: the job's identity is in the annotations.
    """
    value = f"{namespace}.{name}"
    if len(value) <= 63 and _LABEL_VALUE.match(value):
        return value
    digest = hashlib.sha256(f"{namespace}/{name}".encode()).hexdigest()[:10]
    head = re.sub(r"[^-A-Za-z0-9_.]", "-", name)[:52].strip("-_.")
    return f"{head}-{digest}" if head else digest


@dataclass(frozen=True)
class Mark:
    """rankwatch's record on a node, as read back from its annotations."""

    job: str  # namespace/name
    job_uid: str
    reason: str
    time: datetime.datetime | None
    dry_run: bool
    was_unschedulable: bool
    evidence: str = ""
    diagnosis: str = ""
    expires: datetime.datetime | None = None
    """When rankwatch undoes this cordon by itself (None: it stays until a person undoes it)."""

    @property
    def namespace(self) -> str:
        """The namespace of the job the mark is for."""
        return self.job.partition("/")[0]

    @property
    def cordoned(self) -> bool:
        """rankwatch really changed the node's scheduling (not a dry run)."""
        return not self.dry_run

    def is_for(self, job: str, job_uid: str) -> bool:
        """Same job: same uid when both are known (a recreated job of the same name is another job)."""
        if self.job_uid and job_uid:
            return self.job_uid == job_uid
        return self.job == job

    @classmethod
    def from_annotations(cls, annotations: Mapping[str, str]) -> Mark | None:
        cordoned = annotations.get(CORDONED_BY) == CORDONED_BY_VALUE
        dry_run = annotations.get(DRY_RUN) == "true"
        if not (cordoned or dry_run):
            return None
        return cls(
            job=annotations.get(JOB, ""),
            job_uid=annotations.get(JOB_UID, ""),
            reason=annotations.get(REASON, ""),
            time=parse_time(annotations.get(TIME)),
            dry_run=not cordoned,
            was_unschedulable=annotations.get(WAS_UNSCHEDULABLE) == "true",
            evidence=annotations.get(EVIDENCE, ""),
            diagnosis=annotations.get(DIAGNOSIS, ""),
            # An unreadable expiry (hand-edited) is treated as expired: the undo is always the safe side.
            expires=parse_time(annotations.get(EXPIRES)) or _UNREADABLE if EXPIRES in annotations else None,
        )


@dataclass(frozen=True)
class NodeView:
    """The parts of a Node that remediation decides on, plus its resourceVersion for conditional writes."""

    name: str
    uid: str
    resource_version: str
    unschedulable: bool
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    taints: tuple[Mapping[str, Any], ...]

    @property
    def mark(self) -> Mark | None:
        return Mark.from_annotations(self.annotations)

    @property
    def opted_out(self) -> bool:
        return self.labels.get(OPT_OUT_LABEL) == OPT_OUT_VALUE

    @property
    def uncordoned_at(self) -> datetime.datetime | None:
        return parse_time(self.annotations.get(UNCORDONED_AT))

    @property
    def has_our_taint(self) -> bool:
        return any(taint.get("key") == TAINT_KEY for taint in self.taints)

    @classmethod
    def from_node(cls, node: Mapping[str, Any]) -> NodeView:
        """From a Node in the API's JSON spelling (a watch body, or ``ApiClient.sanitize_for_serialization``)."""
        metadata = node.get("metadata") or {}
        spec = node.get("spec") or {}
        return cls(
            name=metadata["name"],
            uid=metadata.get("uid") or "",
            resource_version=metadata.get("resourceVersion") or "",
            unschedulable=bool(spec.get("unschedulable")),
            labels=dict(metadata.get("labels") or {}),
            annotations=dict(metadata.get("annotations") or {}),
            taints=tuple(dict(taint) for taint in spec.get("taints") or []),
        )


def evidence_text(summary: str, evidence: Mapping[str, Any]) -> str:
    """One annotation value: the summary, then the numbers as compact JSON, cut to a bounded size."""
    text = summary
    if evidence:
        text += " " + json.dumps(evidence, sort_keys=True, separators=(",", ":"), default=str)
    return tenant_text.one_line(text, EVIDENCE_MAX_CHARS)


def mark_patch(
    view: NodeView,
    *,
    job: str,
    job_uid: str,
    job_taint_value: str,
    reason: str,
    evidence: str,
    moment: datetime.datetime,
    dry_run: bool,
    diagnosis: str = "",
    expires: datetime.datetime | None = None,
) -> dict[str, Any]:
    """A JSON merge patch recording the mark, cordoning and tainting unless ``dry_run``.

    It carries the node's resourceVersion, so it fails (409) if the node changed since it was read
    (someone else cordoned or uncordoned it meanwhile): the caller re-reads and decides again.
    """
    annotations: dict[str, str | None] = {
        REASON: reason,
        JOB: job,
        JOB_UID: job_uid,
        TIME: format_time(moment),
        EVIDENCE: evidence,
        DIAGNOSIS: diagnosis or None,
        EXPIRES: format_time(expires) if expires else None,
        UNCORDONED_AT: None,
        UNCORDON_REQUEST: None,
    }
    patch: dict[str, Any] = {"metadata": {"resourceVersion": view.resource_version, "annotations": annotations}}
    if dry_run:
        annotations.update({DRY_RUN: "true", CORDONED_BY: None, WAS_UNSCHEDULABLE: None})
        return patch
    annotations.update(
        {CORDONED_BY: CORDONED_BY_VALUE, DRY_RUN: None, WAS_UNSCHEDULABLE: str(view.unschedulable).lower()}
    )
    taints = [dict(taint) for taint in view.taints if taint.get("key") != TAINT_KEY]
    taints.append({"key": TAINT_KEY, "value": job_taint_value, "effect": TAINT_EFFECT})
    patch["spec"] = {"unschedulable": True, "taints": taints}
    return patch


def undo_patch(view: NodeView, moment: datetime.datetime) -> dict[str, Any]:
    """A JSON merge patch undoing the mark: our taint off, schedulable again only if we cordoned it.

    A node that was unschedulable before rankwatch came stays unschedulable. The undo time stays
    behind (``uncordoned-at``) for the cooldown.
    """
    mark = view.mark
    annotations: dict[str, str | None] = dict.fromkeys(MARK_ANNOTATIONS)
    annotations[UNCORDON_REQUEST] = None
    if mark is not None:
        annotations[UNCORDONED_AT] = format_time(moment)
    patch: dict[str, Any] = {"metadata": {"resourceVersion": view.resource_version, "annotations": annotations}}
    spec: dict[str, Any] = {}
    if view.has_our_taint:
        spec["taints"] = [dict(taint) for taint in view.taints if taint.get("key") != TAINT_KEY] or None
    if mark is not None and mark.cordoned and not mark.was_unschedulable and view.unschedulable:
        spec["unschedulable"] = None
    if spec:
        patch["spec"] = spec
    return patch
