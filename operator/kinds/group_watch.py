"""Groups of other kinds enter the monitor's loop through their injected pods.

A group is followed from the first injected pod of it the operator sees (kopf's pod watch; at a start,
every pod there is) until none of its pods is left running: the monitor then follows it as it follows a
TrainingJob (detector, diagnosis, cordon, alert), keyed by its collector name ``<Kind>:<name>``, and
writes what it finds on the owning object (``group_record.py``). Its size comes from the owner's spec
(the adapter), its settings from the pods' annotations (``group_settings.py``), the diagnosis it already
carries from the owner's annotation (a new leader neither repeats nor loses a follow-up). Once a
diagnosis's cordon is decided, or a group is followed whose diagnosis was cordoned but not yet looked at
for a restart, the group's restart is looked at (``restart.py``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import kopf
import kubernetes

from rankwatch.operator import api
from rankwatch.operator.kinds import injection
from rankwatch.operator.kinds.adapter import Group, group_size, read_owner
from rankwatch.operator.kinds.group_record import GroupRecord, diagnosis_of
from rankwatch.operator.kinds.group_settings import group_settings
from rankwatch.operator.kinds.registry import adapter_for
from rankwatch.operator.kinds.restart import GroupRestarts
from rankwatch.operator.spec import InvalidSpec

log = logging.getLogger(__name__)

FINISHED = ("Succeeded", "Failed")


@dataclass
class _Followed:
    group: Group
    running: dict[str, bool] = field(default_factory=dict)
    """uid -> Running, of the group's pods that have not finished"""


class GroupPods:
    """Which groups have pods alive, and whether any runs; tells the monitor (``monitor`` is the leader's)."""

    def __init__(self, kube: kubernetes.client.ApiClient) -> None:
        self.kube = kube
        self._groups: dict[tuple[str, str], _Followed] = {}
        self._lock = asyncio.Lock()
        self.restarts = GroupRestarts()

    async def observe(self, pod: dict[str, Any], deleted: bool, monitor: Any) -> None:
        if monitor is None or api.JOB_NAME_LABEL in (pod.get("metadata", {}).get("labels") or {}):
            return  # not leading; or a TrainingJob's own pod, followed with its job
        claimed = adapter_for(pod)
        if claimed is None or not injection.is_injected(pod):
            return
        adapter, group = claimed
        key = (group.namespace, group.collector_name)
        uid = pod["metadata"].get("uid", "")
        phase = (pod.get("status") or {}).get("phase")
        async with self._lock:
            followed = self._groups.get(key)
            if deleted or phase in FINISHED:
                if followed is None:
                    return
                followed.running.pop(uid, None)
                if not followed.running:
                    del self._groups[key]
                    monitor.forget(*key)
                    log.info("%s: no pod of it left running; no longer followed", group)
                return
            if followed is None or followed.group.uid != group.uid or key not in monitor.jobs:
                if followed is not None and followed.group.uid != group.uid:  # another owner of the same name
                    monitor.forget(*key)
                try:
                    settings = group_settings(pod, str(group))
                except InvalidSpec as error:
                    log.warning("%s: not followed: %s", group, error)
                    return
                owner = await asyncio.to_thread(read_owner, self.kube, group)
                if owner is None:
                    return  # gone, or another object of its name: its pods are on their way out
                size = await asyncio.to_thread(group_size, self.kube, adapter, owner) or 1
                followed = self._groups[key] = _Followed(group)
                record = GroupRecord(self.kube, adapter, group, settings.remediation)
                spec, diagnosis = settings.spec(size), diagnosis_of(owner)
                record.after_remediation = lambda: self.restarts.schedule(record, spec, monitor)
                monitor.track_group(
                    group.namespace, group.collector_name, spec, record, diagnosis,
                    world_size_known=settings.nproc_per_node > 0,
                )  # fmt: skip
                if diagnosis and diagnosis.active and diagnosis.remediation and not diagnosis.restart:
                    record.after_remediation()  # a previous leader cordoned; the restart was not looked at
                log.info("%s: following its %d pod(s) (%s ranks each)", group, size,
                         settings.nproc_per_node or "unknown")  # fmt: skip
            followed.running[uid] = phase == "Running"
            monitor.group_running(*key, any(followed.running.values()))


@kopf.on.event("pods", annotations={api.TRACING_ANNOTATION: "enabled"})
async def injected_pod_changed(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
    if "group_pods" in memo:
        monitor = memo.watch.monitor if "watch" in memo else None
        await memo.group_pods.observe(dict(body), deleted=type == "DELETED", monitor=monitor)
