"""What rankwatch must know of a job kind it does not own, one adapter per kind, and the calls that
are the same for all of them (the group's owning object, its pods, its token Secret).

A *group* is the set of pods that train together, named by the object that owns them (an Indexed
Job, later a JobSet, a PyTorchJob...). Diagnoses of a group are written where that kind's users look:
Events and annotations on the owning object.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import kubernetes
from kubernetes.client.exceptions import ApiException

from rankwatch.operator import api
from rankwatch.operator.events import EventTarget
from rankwatch.operator.lifecycle import pod_spec


@dataclass(frozen=True)
class Group:
    """The object owning a group of pods; ``uid`` tells it from a deleted one of the same name."""

    api_version: str
    kind: str
    plural: str
    namespace: str
    name: str
    uid: str
    key: str = ""
    """How rankwatch names the kind where two share one name (Volcano's Job: ``VolcanoJob``); else ``kind``."""

    @property
    def kind_key(self) -> str:
        return self.key or self.kind

    def __str__(self) -> str:
        return f"{self.kind_key} {self.namespace}/{self.name}"

    @property
    def collector_name(self) -> str:
        """How the group's sidecars and the collector name it (``RANKWATCH_JOB_NAME``): ``<Kind>:<name>``,
        never a TrainingJob's name (object names have no capitals, no colon)."""
        return api.group_collector_name(self.kind_key, self.name)

    @property
    def event_target(self) -> EventTarget:
        return EventTarget(self.api_version, self.kind, self.name, self.uid, self.namespace)

    @property
    def owner_reference(self) -> dict[str, Any]:
        """For what rankwatch makes for the group (its token Secret): deleted with the group, and never
        in the way of its deletion."""
        return {"apiVersion": self.api_version, "kind": self.kind, "name": self.name, "uid": self.uid}


class KindAdapter(Protocol):
    """One job kind. Methods read the pod or the owning object as the API server has them; none call it."""

    kind: str
    """The owning object's kind, as in ``kubectl get <kind>``."""
    key: str
    """The kind as rankwatch names it, unique among the adapters (``Job``, ``JobSet``, ``VolcanoJob``)."""
    api_version: str
    plural: str
    restart_lever: str | None
    """How a whole group is restarted away from suspects; None: cordon and page only."""

    def group_of(self, pod: Mapping[str, Any]) -> Group | None:
        """The group ``pod`` belongs to, or None when it is not a pod of this kind."""

    def index_of(self, pod: Mapping[str, Any]) -> int | None:
        """The pod's index in its group (its node rank), None when it does not say."""

    def index_field(self) -> pod_spec.FieldPath | None:
        """Where the kubelet finds the pod's index, for the sidecar's env (known only once the pod exists);
        None where the index is known at admission (``index_of`` the pod as created)."""

    def expected_size(self, owner: Mapping[str, Any]) -> int | None:
        """How many pods the group should have, from the owning object."""

    def pod_selector(self, group: Group) -> str:
        """A label selector for exactly the group's pods."""

    def token_secret_name(self, name: str) -> str:
        """The Secret holding the token the sidecars of the group owned by ``name`` present to the collector."""

    def member_pods(self, kube: kubernetes.client.ApiClient, group: Group) -> list[dict[str, Any]]:
        """The group's pods as the API server has them, only those its controller chain really puts in
        the group (a label or owner reference is whatever a pod's creator writes). Blocking."""


@runtime_checkable
class SizeFromReference(Protocol):
    """An adapter of a kind whose owning object may leave its size to an object it refers to (a TrainJob
    to its runtime)."""

    def referred_size(self, kube: kubernetes.client.ApiClient, owner: Mapping[str, Any]) -> int | None:
        """How many pods the object the owner refers to gives the group, None when unknown. Blocking."""


def group_size(kube: kubernetes.client.ApiClient, adapter: KindAdapter, owner: Mapping[str, Any]) -> int | None:
    """How many pods the group should have: what the owning object says, else what the object it refers to
    says (a TrainJob without ``numNodes``: its runtime's). Blocking."""
    size = adapter.expected_size(owner)
    if size is None and isinstance(adapter, SizeFromReference):
        size = adapter.referred_size(kube, owner)
    return size


def owned_by(pod: Mapping[str, Any], api_version: str, kind: str) -> dict[str, Any] | None:
    """The pod's controlling owner reference when it is of ``api_version``/``kind``."""
    for owner in pod.get("metadata", {}).get("ownerReferences") or []:
        if owner.get("controller") and owner.get("apiVersion") == api_version and owner.get("kind") == kind:
            return owner
    return None


def pods_claimed(
    kube: kubernetes.client.ApiClient, adapter: KindAdapter, group: Group, owner_uids: frozenset[str] | None = None
) -> list[dict[str, Any]]:
    """Pods the group's selector finds that ``adapter`` puts in ``group`` (same uid), not being deleted;
    with ``owner_uids``, only those whose controller is one of them (a JobSet's child Jobs). Blocking."""
    listed = kubernetes.client.CoreV1Api(kube).list_namespaced_pod(
        group.namespace, label_selector=adapter.pod_selector(group)
    )
    pods = [kube.sanitize_for_serialization(pod) for pod in listed.items if not pod.metadata.deletion_timestamp]
    claimed = []
    for pod in pods:
        found = adapter.group_of(pod)
        if found is None or found.uid != group.uid:
            continue
        if owner_uids is not None:
            controllers = [o for o in pod["metadata"].get("ownerReferences") or [] if o.get("controller")]
            if not controllers or controllers[0].get("uid") not in owner_uids:
                continue
        claimed.append(pod)
    return claimed


def _api_path(group: Group) -> tuple[str, str]:
    api_group, _, version = group.api_version.rpartition("/")
    return api_group, version


def read_owner(kube: kubernetes.client.ApiClient, group: Group) -> dict[str, Any] | None:
    """The owning object as stored, None when it is gone (or another of the same name replaced it)."""
    api_group, version = _api_path(group)
    try:
        owner = kubernetes.client.CustomObjectsApi(kube).get_namespaced_custom_object(
            api_group, version, group.namespace, group.plural, group.name
        )
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    return owner if owner.get("metadata", {}).get("uid") == group.uid else None


def annotate_owner(kube: kubernetes.client.ApiClient, group: Group, annotations: Mapping[str, str | None]) -> None:
    """Merge ``annotations`` into the owning object's (None removes one). Blocking: call from a thread."""
    api_group, version = _api_path(group)
    kubernetes.client.CustomObjectsApi(kube).patch_namespaced_custom_object(
        api_group, version, group.namespace, group.plural, group.name, {"metadata": {"annotations": dict(annotations)}}
    )


def ensure_token_secret(kube: kubernetes.client.ApiClient, adapter: KindAdapter, group: Group) -> bool:
    """Create the group's token Secret unless it exists; True when this call made it. Blocking."""
    secret = pod_spec.group_token_secret(adapter.token_secret_name(group.name), group.namespace, group.owner_reference)
    try:
        kubernetes.client.CoreV1Api(kube).create_namespaced_secret(group.namespace, secret)
    except ApiException as error:
        if error.status == 409:
            return False
        raise
    return True


def annotation_index(pod: Mapping[str, Any], key: str) -> int | None:
    """A pod's index from its annotation ``key`` (a Job's completion index, a Volcano task's index)."""
    value = (pod.get("metadata", {}).get("annotations") or {}).get(key, "")
    return int(value) if value.isdigit() else None


def annotation_field(key: str) -> pod_spec.FieldPath:
    """The downward-API path of annotation ``key``: the index as an environment variable of the pod."""
    return pod_spec.FieldPath(f"metadata.annotations['{key}']")
