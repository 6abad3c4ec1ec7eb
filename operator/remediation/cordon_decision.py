"""Which of the nodes a diagnosis names rankwatch may cordon, and why not the others (pure).

Input: a :class:`CordonRequest` (what the diagnosis says), a :class:`RemediationPolicy` (the job's
``spec.remediation`` plus the operator-wide :class:`Safeguards`), the nodes that ran the job's
pods and the cluster's nodes as they are now. Output: one :class:`NodeDecision` per named node.
No API calls here, so every safeguard is unit-tested without a cluster.
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from rankwatch.model.finding import Finding, FindingKind
from rankwatch.operator import api
from rankwatch.operator.config import Safeguards
from rankwatch.operator.events import EventTarget
from rankwatch.operator.remediation import circuit_breaker
from rankwatch.operator.remediation.node_marks import Mark, NodeView
from rankwatch.operator.spec import Remediation


@dataclass(frozen=True)
class CordonRequest:
    """What a diagnosis blames, the input of remediation: a job and the finding against it.

    The finding's ``nodes`` are Kubernetes Node names (the pods' ``spec.nodeName``) in its order of
    blame (the first is cordoned first when ``maxNodesPerJob`` cuts the list); its ``summary`` goes
    into Events, its evidence (cut short) into a node annotation. ``job_uid`` tells a recreated job of
    the same name apart; give it whenever known. ``diagnosis`` identifies the diagnosis (its time):
    the same request made again (its first answer lost) finds its own mark and finishes, Events
    included.
    """

    job_namespace: str
    job_name: str
    job_uid: str
    finding: Finding
    diagnosis: str = ""
    job_kind: str = api.KIND
    """The kind of the object the diagnosis is about (a TrainingJob, or the owner of a group: Job, JobSet...)."""
    job_api_version: str = api.API_VERSION

    @property
    def job(self) -> str:
        return f"{self.job_namespace}/{self.job_name}"

    @property
    def target(self) -> EventTarget:
        """The object the job's Events go on."""
        return EventTarget(self.job_api_version, self.job_kind, self.job_name, self.job_uid, self.job_namespace)

    def wrote(self, mark: Mark) -> bool:
        """``mark`` is this very request's (same job, same diagnosis): an earlier try of it wrote it."""
        return bool(self.diagnosis) and mark.diagnosis == self.diagnosis and mark.is_for(self.job, self.job_uid)


@dataclass(frozen=True)
class RemediationPolicy:
    """The job's ``spec.remediation`` (cordon, dryRun, maxNodesPerJob) and the operator's safeguards."""

    job: Remediation = field(default_factory=Remediation)
    safeguards: Safeguards = field(default_factory=Safeguards)

    @classmethod
    def for_job(cls, remediation: Remediation, safeguards: Safeguards) -> RemediationPolicy:
        return cls(remediation, safeguards)


class Outcome(enum.StrEnum):
    """What happened to one named node. The first three change the node; the rest say why not."""

    CORDONED = "cordoned"
    """Now unschedulable, tainted, annotated."""
    TAINTED = "tainted"
    """Was already unschedulable (someone else's cordon): tainted and annotated, so it stays out of
    scheduling if they uncordon it; the undo leaves it unschedulable as it found it."""
    DRY_RUN = "dry_run"
    """Annotated and Events posted; scheduling untouched."""
    ALREADY_CORDONED = "already_cordoned"
    """rankwatch's mark is there already (this job's or another's): nothing new, no new Event."""
    DISABLED = "disabled"
    """``spec.remediation.cordon`` is false."""
    SOFTWARE_FAULT = "software_fault"
    """The finding is the job's own code (mismatched collectives): no node is at fault."""
    LOW_CONFIDENCE = "low_confidence"
    NOT_JOB_NODE = "not_a_node_of_this_job"
    """No pod of the job ran there: rankwatch never touches it."""
    NODE_MISSING = "node_not_found"
    OPTED_OUT = "opted_out"
    """The node carries ``rankwatch.io/remediation=disabled``."""
    COOLDOWN = "cooldown"
    JOB_LIMIT = "job_limit"
    """``spec.remediation.maxNodesPerJob`` reached."""
    NAMESPACE_LIMIT = "namespace_limit"
    """The operator's cap on nodes cordoned for one namespace's jobs reached."""
    CLUSTER_LIMIT = "cluster_limit"
    """The operator's absolute cap on nodes cordoned by rankwatch reached."""
    BREAKER_OPEN = "circuit_breaker_open"
    FAILED = "failed"
    """The API refused or kept conflicting; the message says what."""

    @property
    def changes_node(self) -> bool:
        return self in (Outcome.CORDONED, Outcome.TAINTED, Outcome.DRY_RUN)


@dataclass(frozen=True)
class NodeDecision:
    node: str
    outcome: Outcome
    message: str
    resumed: bool = False
    """The change is on the node already, written by an earlier try of the same request whose answer
    was lost: nothing to write, but its Events (named after the diagnosis, so never two) are due."""


def _unique(names: tuple[str, ...]) -> list[str]:
    return list(dict.fromkeys(names))


def decide(
    request: CordonRequest,
    policy: RemediationPolicy,
    job_nodes: frozenset[str],
    nodes: Mapping[str, NodeView],
    now: datetime.datetime,
) -> list[NodeDecision]:
    """One decision per node ``request`` names, in its order; the checks run cheapest-to-explain first."""
    spec, guards = policy.job, policy.safeguards
    breaker = circuit_breaker.state(nodes.values(), guards.breaker, now)
    room = breaker.room
    # Nodes this job already holds count against its limit (in a dry run its dry-run marks too).
    held = {
        name
        for name, view in nodes.items()
        if (mark := view.mark) is not None
        and mark.is_for(request.job, request.job_uid)
        and (mark.cordoned or spec.dryRun)
    }
    held_by_rankwatch = {name for name, view in nodes.items() if (mark := view.mark) is not None and mark.cordoned}
    held_by_namespace = {
        name for name in held_by_rankwatch if (mark := nodes[name].mark) and mark.namespace == request.job_namespace
    }
    cooldown = datetime.timedelta(seconds=guards.cooldown_seconds)
    decisions = []
    finding = request.finding
    for name in _unique(finding.nodes):

        def decision(outcome: Outcome, message: str, name: str = name) -> None:
            decisions.append(NodeDecision(name, outcome, message))

        view = nodes.get(name)
        mark = view.mark if view is not None else None
        if finding.kind is FindingKind.MISMATCH:
            decision(
                Outcome.SOFTWARE_FAULT,
                f"ranks of {request.job} called different collectives: a fault of the job's code, not of {name}",
            )
        elif not spec.cordon:
            decision(Outcome.DISABLED, "spec.remediation.cordon is false")
        elif finding.confidence < guards.min_confidence:
            decision(
                Outcome.LOW_CONFIDENCE,
                f"confidence {finding.confidence:.2f} is below the operator's minimum {guards.min_confidence:.2f}",
            )
        elif name not in job_nodes:
            decision(Outcome.NOT_JOB_NODE, f"no pod of {request.job} ran on {name}; rankwatch leaves it alone")
        elif view is None:
            decision(Outcome.NODE_MISSING, f"node {name} does not exist (any more)")
        elif mark is not None and request.wrote(mark) and mark.dry_run == spec.dryRun:
            decisions.append(_change(name, mark.dry_run, mark.was_unschedulable, resumed=True))
        elif mark is not None and mark.cordoned:
            whose = "this job" if mark.is_for(request.job, request.job_uid) else f"job {mark.job}"
            decision(Outcome.ALREADY_CORDONED, f"already cordoned by rankwatch for {whose} ({mark.reason})")
        elif mark is not None and spec.dryRun:
            whose = "this job" if mark.is_for(request.job, request.job_uid) else f"job {mark.job}"
            decision(Outcome.ALREADY_CORDONED, f"already annotated by a dry run for {whose}")
        elif view.opted_out:
            decision(Outcome.OPTED_OUT, f"{name} is labelled rankwatch.io/remediation=disabled")
        elif (undone := view.uncordoned_at) is not None and now - undone < cooldown:
            left = int((cooldown - (now - undone)).total_seconds())
            decision(Outcome.COOLDOWN, f"uncordoned {int((now - undone).total_seconds())}s ago; cooldown {left}s left")
        elif name not in held and len(held) >= spec.maxNodesPerJob:
            decision(
                Outcome.JOB_LIMIT,
                f"spec.remediation.maxNodesPerJob={spec.maxNodesPerJob} reached ({', '.join(sorted(held)) or 'none'})",
            )
        elif spec.dryRun:
            held.add(name)
            decisions.append(_change(name, True, view.unschedulable))
        elif len(held_by_namespace) >= guards.max_nodes_per_namespace:
            decision(
                Outcome.NAMESPACE_LIMIT,
                f"rankwatch already holds {len(held_by_namespace)} node(s) cordoned for namespace "
                f"{request.job_namespace} (the operator's cap is {guards.max_nodes_per_namespace}); "
                "undo one (rankwatch uncordon) or ask the operator's admin",
            )
        elif len(held_by_rankwatch) >= guards.max_nodes:
            decision(
                Outcome.CLUSTER_LIMIT,
                f"rankwatch already holds {len(held_by_rankwatch)} node(s) cordoned in the cluster "
                f"(the operator's cap is {guards.max_nodes})",
            )
        elif room <= 0:
            decision(Outcome.BREAKER_OPEN, f"circuit breaker open: {breaker.describe(guards.breaker)}")
        else:
            room -= 1
            held.add(name)
            held_by_rankwatch.add(name)
            held_by_namespace.add(name)
            decisions.append(_change(name, False, view.unschedulable))
    return decisions


def _change(name: str, dry_run: bool, unschedulable: bool, resumed: bool = False) -> NodeDecision:
    """The decision to mark ``name`` (or, ``resumed``, that this request's earlier try marked it)."""
    if dry_run:
        return NodeDecision(name, Outcome.DRY_RUN, f"dry run: would cordon and taint {name}", resumed)
    if unschedulable:
        message = f"{name} was already unschedulable; tainted it so it stays out"
        return NodeDecision(name, Outcome.TAINTED, message, resumed)
    return NodeDecision(name, Outcome.CORDONED, f"cordoned and tainted {name}", resumed)
