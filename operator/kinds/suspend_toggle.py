"""The suspend toggle of an object whose controller ends every pod of the group while the object is
suspended and makes them again, scheduled anew, once it is resumed: a whole-group restart away from the
cordoned suspects (an Indexed Job's ``spec.suspend`` through the batch API; a TrainJob's ``spec.suspend``
and a PyTorchJob's ``spec.runPolicy.suspend`` as custom objects).

Two steps, each level-triggered so that an operator that dies between them never leaves a training job
suspended: ``suspend`` suspends the object and marks it (``rankwatch.io/restart-suspended``) in one
conditional patch; a kopf handler on the objects carrying the mark (so also at a new leader's start)
resumes each once none of its pods is left, and removes the mark. A controller may write nothing on the
object when its last pod goes, so the handler looks again every few seconds until they are gone, within
``DRAIN_PATIENCE_S`` (a kopf timer or daemon would put a finalizer on the user's object).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import kopf
import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch.model.diagnosis_status import DiagnosisStatus
from rankwatch.operator.kinds.adapter import Group
from rankwatch.operator.kinds.lever import LeverRefused
from rankwatch.operator.spec import TrainingJobSpec

log = logging.getLogger(__name__)

SUSPENDED_ANNOTATION = "rankwatch.io/restart-suspended"
"""On an object rankwatch suspended to restart it: the diagnosis's time; removed when it is resumed."""
RESTARTS_ANNOTATION = "rankwatch.io/restarts"
"""On an object: how many times rankwatch restarted it."""
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"

LOOK_AGAIN_S = 2.0
DRAIN_PATIENCE_S = 900.0
"""How long one event's handler waits for the pods to go; the object's next event (or a new leader)
looks again."""
_registered: set[str] = set()


def restarts_of(job: Mapping[str, Any]) -> int:
    value = ((job.get("metadata") or {}).get("annotations") or {}).get(RESTARTS_ANNOTATION, "0")
    return int(value) if value.isdigit() else 0


class ObjectApi(Protocol):
    """Reads and patches one kind's objects (raising the client's ``ApiException``)."""

    api_version: str
    plural: str

    def get(self, kube: kubernetes.client.ApiClient, namespace: str, name: str) -> dict[str, Any]: ...

    def patch(self, kube: kubernetes.client.ApiClient, namespace: str, name: str, body: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class CustomObjects:
    api_version: str
    plural: str

    @property
    def _group_version(self) -> tuple[str, str]:
        group, _, version = self.api_version.rpartition("/")
        return group, version

    def get(self, kube: kubernetes.client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
        api = kubernetes.client.CustomObjectsApi(kube)
        return dict(api.get_namespaced_custom_object(*self._group_version, namespace, self.plural, name))

    def patch(self, kube: kubernetes.client.ApiClient, namespace: str, name: str, body: dict[str, Any]) -> None:
        api = kubernetes.client.CustomObjectsApi(kube)
        api.patch_namespaced_custom_object(*self._group_version, namespace, self.plural, name, body)


@dataclass(frozen=True)
class BatchJobs:
    api_version: str = "batch/v1"
    plural: str = "jobs"

    def get(self, kube: kubernetes.client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
        job = kubernetes.client.BatchV1Api(kube).read_namespaced_job(name, namespace)
        return dict(kube.sanitize_for_serialization(job))  # the API's own field names, as in a watch event

    def patch(self, kube: kubernetes.client.ApiClient, namespace: str, name: str, body: dict[str, Any]) -> None:
        kubernetes.client.BatchV1Api(kube).patch_namespaced_job(name, namespace, body)


@dataclass(frozen=True)
class SuspendToggle:
    kind: str
    objects: ObjectApi
    field: tuple[str, ...]
    """Where the suspend flag sits under ``spec``."""
    drained: Callable[[kubernetes.client.ApiClient, Mapping[str, Any]], bool]
    """True once none of the object's pods is left (its controller has ended them all)."""
    handler_id: str

    def suspended(self, job: Mapping[str, Any]) -> bool:
        value: Any = job.get("spec") or {}
        for key in self.field:
            value = (value or {}).get(key) if isinstance(value, Mapping) else None
        return bool(value)

    def _spec_patch(self, suspend: bool) -> dict[str, Any]:
        patch: dict[str, Any] = {self.field[-1]: suspend}
        for key in reversed(self.field[:-1]):
            patch = {key: patch}
        return patch

    def owner_of_suspend(self, job: Mapping[str, Any]) -> str | None:
        """Who else owns the suspend flag (said as a reason): Kueue when it admits the object, or a
        controller that owns the object; None when nobody."""
        metadata = job.get("metadata") or {}
        if KUEUE_QUEUE in (metadata.get("labels") or {}) or KUEUE_QUEUE in (metadata.get("annotations") or {}):
            return f"Kueue admits this {self.kind} ({KUEUE_QUEUE}): its spec.{'.'.join(self.field)} is Kueue's"
        controller = next((o for o in metadata.get("ownerReferences") or [] if o.get("controller")), None)
        if controller is not None:
            return f"the {self.kind} is controlled by {controller.get('kind')} {controller.get('name')}, which owns it"
        return None

    def refusal_of_state(self, job: Mapping[str, Any], spec: TrainingJobSpec) -> str | None:
        """Refused when suspended already or past ``rankwatch.io/max-restarts``."""
        if self.suspended(job):
            return f"the {self.kind} is suspended already"
        used = restarts_of(job)
        if used >= spec.recovery.maxRestarts:
            return f"{used} restart(s) of at most {spec.recovery.maxRestarts} used ({RESTARTS_ANNOTATION})"
        return None

    def suspend(
        self, kube: kubernetes.client.ApiClient, group: Group, owner: Mapping[str, Any], diagnosis: DiagnosisStatus,
        spec: TrainingJobSpec,
    ) -> str:  # fmt: skip
        """Suspend and mark in one conditional patch; what was done, for the job's record."""
        restarts = restarts_of(owner) + 1
        patch = {
            "metadata": {
                "resourceVersion": owner["metadata"]["resourceVersion"],
                "annotations": {SUSPENDED_ANNOTATION: diagnosis.time, RESTARTS_ANNOTATION: str(restarts)},
            },
            "spec": self._spec_patch(True),
        }
        try:
            self.objects.patch(kube, group.namespace, group.name, patch)
        except ApiException as error:
            if error.status == 409:
                raise LeverRefused(f"the {self.kind} changed while rankwatch suspended it") from None
            raise
        return (
            f"suspended the {self.kind} to end every pod, resumed once they are gone (restart {restarts} of at most "
            f"{spec.recovery.maxRestarts})"
        )

    def resume_when_drained(self, kube: kubernetes.client.ApiClient, job: Mapping[str, Any]) -> bool:
        """Resume an object rankwatch suspended once its pods are gone (and drop the mark); True when it
        was resumed now. Blocking."""
        metadata = job.get("metadata") or {}
        if self.suspended(job) and not self.drained(kube, job):
            return False
        patch: dict[str, Any] = {
            "metadata": {"resourceVersion": metadata["resourceVersion"], "annotations": {SUSPENDED_ANNOTATION: None}},
            "spec": self._spec_patch(False),
        }
        try:
            self.objects.patch(kube, metadata["namespace"], metadata["name"], patch)
        except ApiException as error:
            if error.status in (404, 409):
                return False  # gone, or changed: looked at again
            raise
        log.warning("%s %s/%s: its pods are gone; resumed (restart away from the suspects)",
                    self.kind, metadata["namespace"], metadata["name"])  # fmt: skip
        return True

    def _marked(self, kube: kubernetes.client.ApiClient, namespace: str, name: str, uid: str) -> dict[str, Any] | None:
        """The object as stored while it is the same one and still carries the mark, else None."""
        try:
            found = self.objects.get(kube, namespace, name)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        metadata = found.get("metadata") or {}
        marked = SUSPENDED_ANNOTATION in (metadata.get("annotations") or {})
        return found if metadata.get("uid") == uid and marked else None

    async def on_marked(self, body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
        """kopf's handler for an object carrying the mark: resume it once its pods are gone."""
        if type == "DELETED" or "kube" not in memo:
            return
        metadata = body.get("metadata") or {}
        namespace, name, uid = metadata.get("namespace", ""), metadata.get("name", ""), metadata.get("uid", "")
        deadline = time.monotonic() + DRAIN_PATIENCE_S
        while memo.leading() and time.monotonic() < deadline:  # not leading: the leader resumes it
            current = await asyncio.to_thread(self._marked, memo.kube, namespace, name, uid)
            if current is None or await asyncio.to_thread(self.resume_when_drained, memo.kube, current):
                return
            await asyncio.sleep(LOOK_AGAIN_S)

    def watch(self) -> None:
        """Register ``on_marked`` (from the operator's startup, before kopf starts watching): only with the
        admission webhook on, the only case the chart grants a watch on the kind. Where its CRD is not
        installed, kopf serves it once it is."""
        if self.handler_id in _registered:
            return  # a second start in one process: kopf's registry keeps the first
        group, _, version = self.objects.api_version.rpartition("/")
        kopf.on.event(group, version, self.objects.plural, id=self.handler_id,
                      annotations={SUSPENDED_ANNOTATION: kopf.PRESENT})(self.on_marked)  # fmt: skip
        _registered.add(self.handler_id)
