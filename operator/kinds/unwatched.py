"""Opted-in pods that run without the injection are reported, never silently unwatched.

The webhook fails open: a pod created while the operator was down (or the webhook not installed, or
its namespace not labelled, or a pod the webhook could not inject) starts as its owner made it. The
operator sees every opted-in pod (kopf's pod watch); those without the injection are counted, until
they finish, on ``rankwatch_unwatched_pods{kind}``, and their group hears of it: one Warning Event ``Unwatched`` on
the owning object (the same Event counted up as more come), naming the pods and why, and the
annotation ``rankwatch.io/unwatched-pods`` with how many run now. A pod no supported kind owns gets
the Event itself.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import kopf
import kubernetes
from kubernetes.client.exceptions import ApiException
from prometheus_client import Gauge

from rankwatch.model import event_reasons
from rankwatch.operator import api
from rankwatch.operator.events import EventTarget, post_event
from rankwatch.operator.kinds import injection, trainjob
from rankwatch.operator.kinds.adapter import Group, KindAdapter, annotate_owner, group_size, read_owner
from rankwatch.operator.kinds.registry import adapter_for

log = logging.getLogger(__name__)

FINISHED = ("Succeeded", "Failed")
REPORT_DELAY_S = 2.0
"""Pods of one group seen within this delay make one report (a Job's pods come together)."""
NAMESPACE_CACHE_S = 30.0
NAMES_SHOWN = 10
WEBHOOK_AWAY = "the webhook did not see it (the operator was down or unreachable, or the webhook is not installed)"


@dataclass
class _Report:
    target: EventTarget
    group: Group | None
    """None: the pod has no supported owner; the Event goes on the pod."""
    adapter: KindAdapter | None
    pods: dict[str, str] = field(default_factory=dict)
    """pod name -> why it was not injected"""
    pending: asyncio.Task[None] | None = None


class UnwatchedPods:
    def __init__(self, kube: kubernetes.client.ApiClient, gauge: Gauge) -> None:
        self.gauge = gauge  # DiagnosisMetrics.unwatched_pods
        self.kube = kube
        self._pods: dict[str, tuple[tuple[str, ...], str, str]] = {}  # uid -> (report key, kind, name)
        self._reports: dict[tuple[str, ...], _Report] = {}
        self._namespaces: dict[str, tuple[bool, float]] = {}

    async def observe(self, pod: dict[str, Any], deleted: bool) -> None:
        metadata = pod.get("metadata", {})
        uid, name, namespace = metadata.get("uid", ""), metadata.get("name", ""), metadata.get("namespace", "")
        if deleted or pod.get("status", {}).get("phase") in FINISHED:
            self._forget(uid)  # nothing left to watch: no longer counted, and never news at first sight
            return
        if uid in self._pods or not injection.opted_in(pod) or injection.is_injected(pod):
            return
        if api.JOB_NAME_LABEL in (metadata.get("labels") or {}):
            return  # a TrainingJob's own pod, built with tracing as its spec says
        why = (metadata.get("annotations") or {}).get(api.NOT_INJECTED_ANNOTATION)
        if why is None:
            why = WEBHOOK_AWAY if await self._namespace_opted_in(namespace) else (
                f"its namespace lacks the label {api.INJECT_NAMESPACE_LABEL}={api.INJECT_NAMESPACE_VALUE}"
            )  # fmt: skip
        claimed = adapter_for(await self._with_trainjob_uid(pod))
        adapter: KindAdapter | None = None
        if claimed is not None:
            adapter, group = claimed
            key: tuple[str, ...] = (group.kind_key, group.namespace, group.uid)
            kind, target = group.kind_key, group.event_target
        else:
            group, key, kind = None, ("Pod", namespace, uid), "unsupported"
            target = EventTarget("v1", "Pod", name, uid, namespace)
        self._pods[uid] = (key, kind, name)
        self.gauge.labels(kind).inc()
        report = self._reports.setdefault(key, _Report(target, group, adapter))
        report.pods[name] = why
        self._schedule(key)

    def _forget(self, uid: str) -> None:
        known = self._pods.pop(uid, None)
        if known is None:
            return
        key, kind, name = known
        self.gauge.labels(kind).dec()
        report = self._reports.get(key)
        if report is not None:
            report.pods.pop(name, None)
            self._schedule(key)

    def _schedule(self, key: tuple[str, ...]) -> None:
        report = self._reports[key]
        if report.pending is None or report.pending.done():
            report.pending = asyncio.create_task(self._report_later(key))

    async def _report_later(self, key: tuple[str, ...]) -> None:
        await asyncio.sleep(REPORT_DELAY_S)
        report = self._reports[key]
        report.pending = None
        pods = dict(report.pods)
        if not pods and report.group is None:
            del self._reports[key]
            return
        try:
            await asyncio.to_thread(self._write, report, pods)
        except Exception as error:
            log.warning("unwatched pods of %s not reported: %s", report.group or report.target.name, error)
        if not pods:
            self._reports.pop(key, None)

    def _write(self, report: _Report, pods: dict[str, str]) -> None:
        if pods:
            names = sorted(pods)
            shown = ", ".join(names[:NAMES_SHOWN]) + (
                f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else ""
            )
            reasons = "; ".join(sorted(set(pods.values()))[:3])
            message = (
                f"{len(names)}{self._of_size(report)} opted-in pod(s) run without rankwatch's injection, so rankwatch "
                f"does not watch them: {shown}. Why: {reasons}. Pods created once the webhook injects them are watched."
            )
            now = datetime.datetime.now(datetime.UTC)
            post_event(
                self.kube, report.target, type="Warning", reason=event_reasons.UNWATCHED, message=message,
                key=event_reasons.UNWATCHED, repeat=True, now=now,
            )  # fmt: skip
            log.warning("%s: %s", report.group or f"Pod {report.target.namespace}/{report.target.name}", message)
        if report.group is not None:
            try:
                annotate_owner(self.kube, report.group, {api.UNWATCHED_ANNOTATION: str(len(pods)) if pods else None})
            except ApiException as error:
                if error.status != 404:  # the owner is gone: nothing to say it on
                    raise

    def _of_size(self, report: _Report) -> str:
        """`` of 4`` when the group's size is known (the owner read now), else nothing."""
        if report.group is None or report.adapter is None:
            return ""
        try:
            owner = read_owner(self.kube, report.group)
        except ApiException:
            return ""
        size = group_size(self.kube, report.adapter, owner) if owner is not None else None
        return f" of {size}" if size else ""

    async def _with_trainjob_uid(self, pod: dict[str, Any]) -> dict[str, Any]:
        """``pod`` as the webhook would have marked it: a TrainJob's pod carries only its JobSet's labels,
        so the JobSet is read to report the pod on the TrainJob controlling it (on the JobSet if unreadable)."""
        if trainjob.jobset.UID_LABEL not in (pod["metadata"].get("labels") or {}):
            return pod
        try:
            owner_uid = await asyncio.to_thread(trainjob.trainjob_uid, self.kube, pod)
        except ApiException as error:
            log.warning("JobSet of pod %s not readable (HTTP %s): reported on the JobSet", pod["metadata"].get("name"),
                        error.status)  # fmt: skip
            owner_uid = None
        return trainjob.marked(pod, owner_uid)

    async def _namespace_opted_in(self, namespace: str) -> bool:
        cached = self._namespaces.get(namespace)
        if cached and time.monotonic() - cached[1] < NAMESPACE_CACHE_S:
            return cached[0]
        try:
            found = await asyncio.to_thread(kubernetes.client.CoreV1Api(self.kube).read_namespace, namespace)
            labels = found.metadata.labels or {}
            opted = labels.get(api.INJECT_NAMESPACE_LABEL) == api.INJECT_NAMESPACE_VALUE
        except ApiException as error:
            log.warning("namespace %s not readable (HTTP %s): taking it as opted in", namespace, error.status)
            opted = True
        self._namespaces[namespace] = (opted, time.monotonic())
        return opted


@kopf.on.event("pods", annotations={api.INJECT_ANNOTATION: "true"})
async def opted_in_pod_changed(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
    if "unwatched" in memo:
        await memo.unwatched.observe(dict(body), deleted=type == "DELETED")
