"""Remediation: take the nodes a diagnosis blames out of scheduling, safely, and put them back on request.

Entry points (blocking; the ``*_async`` forms run them in a thread for the kopf event loop):

- :func:`remediate` ``(api, request, policy) -> RemediationResult``: per named node, cordon
  (``spec.unschedulable``), taint ``rankwatch.io/suspect=<ns>.<job>:NoSchedule``, annotate
  (who, why, when, evidence, prior schedulability), Event on the Node and on the job; or say why
  not (see :class:`~rankwatch.operator.remediation.cordon_decision.Outcome`).
- :func:`uncordon` ``(api, node) -> UncordonResult`` and :func:`uncordon_job`: the undo, used by
  ``rankwatch uncordon`` and by the operator when a node gets ``rankwatch.io/uncordon=true``.

Idempotent and restart-safe: what was done is read back from the nodes' annotations each time,
writes are conditional on the node's resourceVersion, and Events are named after what they
report, so re-running for the same job and node changes nothing and posts nothing new.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import threading
from dataclasses import dataclass, replace

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rankwatch.kube import TRANSIENT_ATTEMPTS, is_transient
from rankwatch.model import event_reasons
from rankwatch.operator import events
from rankwatch.operator.events import EventTarget
from rankwatch.operator.remediation import circuit_breaker, node_actions, node_marks
from rankwatch.operator.remediation.cordon_decision import (
    CordonRequest,
    NodeDecision,
    Outcome,
    RemediationPolicy,
    Safeguards,
    decide,
)
from rankwatch.operator.remediation.metrics import RemediationMetrics
from rankwatch.operator.remediation.node_marks import NodeView

__all__ = [
    "CordonRequest",
    "NodeDecision",
    "Outcome",
    "RemediationPolicy",
    "RemediationResult",
    "Safeguards",
    "UncordonResult",
    "expire_cordons",
    "expire_cordons_periodically",
    "remediate",
    "remediate_async",
    "uncordon",
    "uncordon_async",
    "uncordon_job",
]

log = logging.getLogger(__name__)

ATTEMPTS = 5
"""Re-reads after a conflicting write (someone else changed the node between our read and write)."""

# One decision at a time in this process: the breaker's count must include the cordons the
# previous decision just made. Across replicas, cordons are re-counted after writing (see below).
_LOCK = threading.Lock()


@dataclass(frozen=True)
class RemediationResult:
    request: CordonRequest
    decisions: tuple[NodeDecision, ...]
    """One per node the request names, in its order."""
    dry_run: bool
    breaker_open: bool
    """The circuit breaker stopped at least one cordon."""

    def nodes(self, *outcomes: Outcome) -> tuple[str, ...]:
        return tuple(d.node for d in self.decisions if d.outcome in outcomes)

    @property
    def cordoned(self) -> tuple[str, ...]:
        """Nodes taken out of scheduling by this call (cordoned, or tainted if already unschedulable)."""
        return self.nodes(Outcome.CORDONED, Outcome.TAINTED)


def remediate(
    api: client.ApiClient,
    request: CordonRequest,
    policy: RemediationPolicy,
    *,
    now: datetime.datetime | None = None,
    job_nodes: frozenset[str] | None = None,
    metrics: RemediationMetrics | None = None,
) -> RemediationResult:
    """Cordon what ``policy`` allows of the nodes ``request`` names.

    ``job_nodes``: the nodes the job's own pods run on, when the job is not a TrainingJob (its caller
    knows which pods are the group's); a TrainingJob's are read here. A write to one node that fails is
    that node's ``FAILED`` outcome; failing to read the nodes or the job's pods raises ``ApiException``
    (nothing was changed then; call again later).
    """
    metrics = metrics or RemediationMetrics.uncounted()
    with _LOCK:
        moment = now or node_marks.now()
        if job_nodes is None:
            job_nodes = node_actions.nodes_of_job(api, request.job_namespace, request.job_name, request.job_uid)
        done: dict[str, NodeDecision] = {}
        decisions: list[NodeDecision] = []
        for _attempt in range(ATTEMPTS):
            nodes = node_actions.list_nodes(api)
            decisions = decide(request, policy, job_nodes, nodes, moment)
            conflict = False
            for decision in decisions:
                if decision.node in done or not decision.outcome.changes_node:
                    continue
                if decision.resumed:  # an earlier try wrote it; only its Events are left to do
                    done[decision.node] = decision
                    continue
                try:
                    expires = _expiry(api, decision, request, policy.safeguards, moment)
                    written = _write_mark(api, nodes[decision.node], request, decision, moment, expires)
                except ApiException as error:  # 403, 422, 5xx tried again and again: this node fails, the others go on
                    tries = f" ({TRANSIENT_ATTEMPTS} tries)" if is_transient(error) else ""
                    message = f"writing to {decision.node} failed: HTTP {error.status} {error.reason}{tries}"
                    done[decision.node] = NodeDecision(decision.node, Outcome.FAILED, message)
                    continue
                if not written:
                    conflict = True  # the node changed under us: read everything again, decide again
                    break
                done[decision.node] = decision
            if not conflict:
                break
        final = [done.get(d.node, d) for d in decisions]
        final = [
            NodeDecision(d.node, Outcome.FAILED, f"{d.node} kept changing while rankwatch wrote to it; try again")
            if d.outcome.changes_node and d.node not in done
            else d
            for d in final
        ]
        final = _roll_back_over_cap(api, policy, final, moment, request.job_namespace)
    result = RemediationResult(
        request, tuple(final), policy.job.dryRun, any(d.outcome is Outcome.BREAKER_OPEN for d in final)
    )
    _report(api, result, policy, nodes, moment, metrics)
    return result


async def remediate_async(
    api: client.ApiClient,
    request: CordonRequest,
    policy: RemediationPolicy,
    job_nodes: frozenset[str] | None = None,
    *,
    metrics: RemediationMetrics | None = None,
) -> RemediationResult:
    """:func:`remediate` off the event loop."""
    return await asyncio.to_thread(remediate, api, request, policy, job_nodes=job_nodes, metrics=metrics)


def _expiry(
    api: client.ApiClient,
    decision: NodeDecision,
    request: CordonRequest,
    safeguards: Safeguards,
    moment: datetime.datetime,
) -> datetime.datetime | None:
    """When the cordon ends by itself: for a node other namespaces' pods use (or may use), after
    ``shared_expiry_seconds``; for one only the job's namespace uses, never (a person undoes it)."""
    if decision.outcome is Outcome.DRY_RUN or not node_actions.shared_with_others(
        api, decision.node, request.job_namespace
    ):
        return None
    return moment + datetime.timedelta(seconds=safeguards.shared_expiry_seconds)


def _write_mark(
    api: client.ApiClient,
    view: NodeView,
    request: CordonRequest,
    decision: NodeDecision,
    moment: datetime.datetime,
    expires: datetime.datetime | None = None,
) -> bool:
    patch = node_marks.mark_patch(
        view,
        job=request.job,
        job_uid=request.job_uid,
        job_taint_value=node_marks.taint_value(request.job_namespace, request.job_name),
        reason=request.finding.kind,
        evidence=node_marks.evidence_text(request.finding.summary, request.finding.evidence),
        moment=moment,
        dry_run=decision.outcome is Outcome.DRY_RUN,
        diagnosis=request.diagnosis,
        expires=expires,
    )
    return node_actions.patch_node(api, view.name, patch)


def _roll_back_over_cap(
    api: client.ApiClient,
    policy: RemediationPolicy,
    decisions: list[NodeDecision],
    moment: datetime.datetime,
    namespace: str,
) -> list[NodeDecision]:
    """Re-count after writing; over the cap (another replica cordoned at the same time), take back
    our own new cordons, last named first (see :func:`circuit_breaker.excess` for why this holds)."""
    ours = [d.node for d in decisions if d.outcome in (Outcome.CORDONED, Outcome.TAINTED)]
    if not ours:
        return decisions
    settings = policy.safeguards.breaker
    nodes = node_actions.list_nodes(api)
    breaker = circuit_breaker.state(nodes.values(), settings, moment)
    over = max(circuit_breaker.excess(breaker), _over_caps(nodes, policy.safeguards, namespace))
    late = set(ours[len(ours) - min(len(ours), over) :])
    for name in late:
        for _attempt in range(ATTEMPTS):
            view = node_actions.read_node(api, name)
            if view is None:
                break
            patch = node_marks.undo_patch(view, moment)
            patch["metadata"]["annotations"][node_marks.UNCORDONED_AT] = None  # not a person's undo: no cooldown
            if node_actions.patch_node(api, name, patch):
                break
    message = f"circuit breaker open or a cap reached (a concurrent cordon came first): {breaker.describe(settings)}"
    return [replace(d, outcome=Outcome.BREAKER_OPEN, message=message) if d.node in late else d for d in decisions]


def _over_caps(nodes: dict[str, NodeView], safeguards: Safeguards, namespace: str) -> int:
    """Cordons beyond the absolute and the per-namespace caps, re-counted after writing (as the breaker)."""
    marks = [mark for view in nodes.values() if (mark := view.mark) is not None and mark.cordoned]
    in_namespace = sum(mark.namespace == namespace for mark in marks)
    return max(len(marks) - safeguards.max_nodes, in_namespace - safeguards.max_nodes_per_namespace, 0)


_SKIP_EVENTS = {
    Outcome.NOT_JOB_NODE: ("Warning", event_reasons.CORDON_REFUSED),
    Outcome.NODE_MISSING: ("Warning", event_reasons.CORDON_REFUSED),
    Outcome.FAILED: ("Warning", event_reasons.CORDON_FAILED),
    Outcome.BREAKER_OPEN: ("Warning", event_reasons.CIRCUIT_BREAKER_OPEN),
    Outcome.JOB_LIMIT: ("Normal", event_reasons.CORDON_SKIPPED),
    Outcome.NAMESPACE_LIMIT: ("Warning", event_reasons.CORDON_CAP_REACHED),
    Outcome.CLUSTER_LIMIT: ("Warning", event_reasons.CORDON_CAP_REACHED),
    Outcome.OPTED_OUT: ("Normal", event_reasons.CORDON_SKIPPED),
    Outcome.COOLDOWN: ("Normal", event_reasons.CORDON_SKIPPED),
    Outcome.LOW_CONFIDENCE: ("Normal", event_reasons.CORDON_SKIPPED),
    Outcome.SOFTWARE_FAULT: ("Normal", event_reasons.CORDON_SKIPPED),
}
"""Outcomes that change nothing but that people should see on the job. ALREADY_CORDONED and
DISABLED stay quiet: nothing new happened, or the job asked for nothing."""


def _report(
    api: client.ApiClient,
    result: RemediationResult,
    policy: RemediationPolicy,
    nodes: dict[str, NodeView],
    moment: datetime.datetime,
    metrics: RemediationMetrics,
) -> None:
    """Events, log lines and metrics for what happened. An Event that cannot be posted is logged, not fatal."""
    request = result.request
    job = request.target
    finding = request.finding
    why = f"{finding.kind}: {finding.summary}" if finding.summary else finding.kind
    # The cordon's Events are named after the diagnosis (not the call's time), so a repeat of the same
    # request whose first answer was lost posts them once: not twice, not never.
    decision_id = f"{request.job_uid or request.job}/{request.diagnosis}" if request.diagnosis else ""
    stamp = decision_id or node_marks.format_time(moment)
    for decision in result.decisions:
        outcome, node = decision.outcome, decision.node
        posts: list[tuple[EventTarget, str, str, str, str, bool]] = []
        if outcome.changes_node:
            dry = outcome is Outcome.DRY_RUN
            view = nodes.get(node)  # None only if the node was deleted between two attempts
            target = EventTarget.node(view.name, view.uid) if view else EventTarget("v1", "Node", node, "")
            if dry:
                text = f"dry run: rankwatch would cordon and taint {node} for {request.job_kind} {request.job} ({why})"
                posts += [(target, "Normal", event_reasons.CORDON_DRY_RUN, text, f"dry-run/{stamp}", False)]
                posts += [(job, "Normal", event_reasons.NODE_CORDON_DRY_RUN, text, f"dry-run/{node}/{stamp}", False)]
            else:
                text = f"rankwatch {decision.message} for {request.job_kind} {request.job} ({why})"
                text += f"; undo: rankwatch uncordon {node}"
                posts += [(target, "Warning", event_reasons.CORDONED_BY_RANKWATCH, text, f"cordon/{stamp}", False)]
                posts += [(job, "Normal", event_reasons.NODE_CORDONED, text, f"cordon/{node}/{stamp}", False)]
            log.warning("%s %s: %s", request.job_kind, request.job, text)
        elif outcome in _SKIP_EVENTS:
            metrics.not_cordoned.labels(outcome=outcome.value).inc()
            type_, reason = _SKIP_EVENTS[outcome]
            text = f"did not cordon {node}: {decision.message}"
            posts += [(job, type_, reason, text, f"{outcome.value}/{node}", True)]
            level = logging.WARNING if type_ == "Warning" else logging.INFO
            log.log(level, "%s %s: %s", request.job_kind, request.job, text)
        posted = [_post(api, *post, moment) for post in posts]
        # Counted once per cordon: a resumed one only if its Event was new (its first try stopped before).
        if outcome.changes_node and (not decision.resumed or posted[0]):
            metrics.cordoned.labels(kind=request.finding.kind, dry_run=str(outcome is Outcome.DRY_RUN).lower()).inc()
    if result.breaker_open:
        metrics.breaker_trips.inc()
        log.warning(
            "CIRCUIT BREAKER OPEN: rankwatch stopped cordoning for %s %s (nodes %s); undo stays possible",
            request.job_kind,
            request.job,
            ", ".join(result.nodes(Outcome.BREAKER_OPEN)),
        )
    if not policy.job.dryRun and any(
        d.outcome in (Outcome.CORDONED, Outcome.TAINTED, Outcome.BREAKER_OPEN) for d in result.decisions
    ):
        metrics.breaker_tripped.set(1 if result.breaker_open else 0)


def _post(
    api: client.ApiClient,
    target: EventTarget,
    type_: str,
    reason: str,
    text: str,
    key: str,
    repeat: bool,
    moment: datetime.datetime,
) -> bool:
    """True if the Event is new; an Event that cannot be posted is logged, not fatal."""
    try:
        return events.post_event(
            api, target, type=type_, reason=reason, message=text, key=key, repeat=repeat, now=moment
        )
    except ApiException as error:
        log.error("could not post Event %s on %s %s: HTTP %s", reason, target.kind, target.name, error.status)
        return False


# ---- undo -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class UncordonResult:
    node: str
    undone: bool
    """rankwatch's mark (cordon, taint, or dry-run annotations) was there and is gone now."""
    message: str
    error: bool = False
    """The node is missing or kept changing: nothing was undone and a person should look."""


def uncordon(
    api: client.ApiClient,
    node: str,
    *,
    via: str = "cli",
    now: datetime.datetime | None = None,
    metrics: RemediationMetrics | None = None,
) -> UncordonResult:
    """Undo rankwatch's cordon of ``node``: taint off, schedulable again unless it was unschedulable
    before rankwatch, annotations cleared (``uncordoned-at`` stays for the cooldown), Events on the
    node and the job. Never consults the circuit breaker. A node rankwatch did not mark is left
    as it is (only a pending ``rankwatch.io/uncordon`` request is removed)."""
    moment = now or node_marks.now()
    for _attempt in range(ATTEMPTS):
        view = node_actions.read_node(api, node)
        if view is None:
            return UncordonResult(node, False, f"node {node} not found", error=True)
        mark = view.mark
        requested = node_marks.UNCORDON_REQUEST in view.annotations
        if mark is None and not view.has_our_taint:
            if requested:
                patch = {"metadata": {"annotations": {node_marks.UNCORDON_REQUEST: None}}}
                node_actions.patch_node(api, node, patch)
            return UncordonResult(node, False, f"{node} is not cordoned by rankwatch; left as it is")
        if node_actions.patch_node(api, node, node_marks.undo_patch(view, moment)):
            break
    else:
        return UncordonResult(node, False, f"{node} kept changing while rankwatch wrote to it; try again", error=True)
    if mark is None:
        message = f"removed the {node_marks.TAINT_KEY} taint from {node} (its annotations were gone)"
    elif mark.dry_run:
        message = f"cleared the dry-run annotations of {node} (TrainingJob {mark.job})"
    elif mark.was_unschedulable:
        message = f"removed rankwatch's taint from {node} (TrainingJob {mark.job}); "
        message += "it stays unschedulable, as rankwatch found it"
    else:
        message = f"uncordoned {node} and removed rankwatch's taint (TrainingJob {mark.job})"
    (metrics or RemediationMetrics.uncounted()).uncordoned.labels(via=via).inc()
    log.warning("%s (via %s)", message, via)
    posts = [(EventTarget.node(view.name, view.uid), event_reasons.UNCORDONED_BY_RANKWATCH)]
    if mark is not None and "/" in mark.job:
        namespace, name = mark.job.split("/", 1)
        posts.append((EventTarget.job(namespace, name, mark.job_uid), event_reasons.NODE_UNCORDONED))
    key = f"uncordon/{node_marks.format_time(moment)}"
    for target, reason in posts:
        _post(api, target, "Normal", reason, f"{message} (via {via})", key, False, moment)
    return UncordonResult(node, True, message)


def expire_cordons(
    api: client.ApiClient, *, now: datetime.datetime | None = None, metrics: RemediationMetrics | None = None
) -> list[UncordonResult]:
    """Undo every cordon of rankwatch whose expiry (``rankwatch.io/cordon-expires-at``) has passed."""
    moment = now or node_marks.now()
    due = [
        view.name
        for view in node_actions.list_nodes(api).values()
        if (mark := view.mark) is not None and mark.expires is not None and mark.expires <= moment
    ]
    return [uncordon(api, node, via="expiry", now=moment, metrics=metrics) for node in sorted(due)]


async def expire_cordons_periodically(
    api: client.ApiClient, metrics: RemediationMetrics, interval_seconds: float = 60.0
) -> None:
    """:func:`expire_cordons` every ``interval_seconds`` (the leader runs it); a failed pass is logged."""
    while True:
        try:
            await asyncio.to_thread(expire_cordons, api, metrics=metrics)
        except ApiException as error:
            log.error("could not expire rankwatch's cordons: HTTP %s %s", error.status, error.reason)
        await asyncio.sleep(interval_seconds)


def uncordon_job(api: client.ApiClient, namespace: str, name: str, *, via: str = "cli") -> list[UncordonResult]:
    """Undo every mark rankwatch made for TrainingJob ``namespace/name`` (any uid)."""
    job = f"{namespace}/{name}"
    marked = [view.name for view in node_actions.list_nodes(api).values() if view.mark and view.mark.job == job]
    return [uncordon(api, node, via=via) for node in sorted(marked)]


async def uncordon_async(
    api: client.ApiClient, node: str, *, via: str, metrics: RemediationMetrics | None = None
) -> UncordonResult:
    """:func:`uncordon` off the event loop."""
    return await asyncio.to_thread(uncordon, api, node, via=via, metrics=metrics)
