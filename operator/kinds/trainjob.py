"""A TrainJob (``trainer.kubeflow.org/v1alpha1``, Kubeflow Trainer v2): the Trainer makes a JobSet of the
TrainJob's name, controlled by it; the JobSet controller one Job per replicatedJob (the training nodes' is
labelled ``trainer.kubeflow.org/trainjob-ancestor-step: trainer``, parallelism ``numNodes``); the Job
controller the pods. So TrainJob -> JobSet -> Job -> Pod, and a pod carries only the JobSet's labels
(``jobset.sigs.k8s.io/jobset-name`` = the TrainJob's name, ``jobset-uid``): nothing on it names the
TrainJob. The webhook therefore reads, at admission, the JobSet the pod's labels name and, when a
TrainJob controls it, writes that TrainJob's uid on the pod (``rankwatch.io/trainjob-uid``,
``trainjob_uid``); a pod's own value of that annotation is replaced or removed, never believed.

- group: the TrainJob named by the JobSet labels and the annotation; members (``member_pods``) are only
  the pods of the training Jobs of the JobSet that TrainJob controls (labels are whatever a pod's
  creator writes; the initializer Jobs are not training nodes);
- size: ``spec.trainer.numNodes``; a TrainJob that leaves it out gets, as the Trainer counts it, its
  runtime's ``mlPolicy.numNodes`` (1 when the mlPolicy leaves it out too), read from the runtime snapshot
  the Trainer keeps for the TrainJob (v2.3: a ConfigMap ``<name>-runtime-snapshot`` it controls), else
  from the (Cluster)TrainingRuntime its ``runtimeRef`` names (``referred_size``);
- index: the Job's completion index, which the Trainer gives torchrun as ``PET_NODE_RANK``; ranks come
  from torchrun's RANK / WORLD_SIZE in each process (``PET_NPROC_PER_NODE`` per node);
- restart lever: the TrainJob's ``spec.suspend`` toggle (``restart_trainjob.py``): the Trainer suspends its
  JobSet, every pod ends; resumed once they are gone, new pods are scheduled away from the cordoned
  suspects. Where Kueue owns ``spec.suspend``, its JobSet's ``failurePolicy`` when the runtime gives one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kubernetes
import yaml
from kubernetes.client.exceptions import ApiException

from rankwatch.operator import api
from rankwatch.operator.kinds import jobset
from rankwatch.operator.kinds.adapter import Group, annotation_field, annotation_index, owned_by, pods_claimed
from rankwatch.operator.kinds.indexed_job import COMPLETION_INDEX
from rankwatch.operator.lifecycle.pod_spec import FieldPath

log = logging.getLogger(__name__)

API_VERSION = "trainer.kubeflow.org/v1alpha1"
TRAINJOB_UID_ANNOTATION = "rankwatch.io/trainjob-uid"
"""On a pod, written by the webhook only: the uid of the TrainJob controlling the pod's JobSet."""
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
TRAINER_ANCESTOR = "trainer"
SNAPSHOT_SUFFIX, SNAPSHOT_KEY = "-runtime-snapshot", "runtime"
"""Trainer v2.3 ``pkg/runtime/core/snapshot.go``: the runtime as the TrainJob was first built from it."""
RUNTIME_PLURALS = {"TrainingRuntime": "trainingruntimes", "ClusterTrainingRuntime": "clustertrainingruntimes"}
DEFAULT_RUNTIME_KIND = "ClusterTrainingRuntime"


class TrainJobAdapter:
    kind = "TrainJob"
    key = "TrainJob"
    api_version = API_VERSION
    plural = "trainjobs"
    restart_lever: str | None = "spec.suspend toggle; under Kueue, its JobSet's failurePolicy"

    def group_of(self, pod: Mapping[str, Any]) -> Group | None:
        metadata = pod.get("metadata", {})
        labels = metadata.get("labels") or {}
        uid = (metadata.get("annotations") or {}).get(TRAINJOB_UID_ANNOTATION)
        name = labels.get(jobset.NAME_LABEL)
        if not name or not isinstance(uid, str) or not uid or owned_by(pod, "batch/v1", "Job") is None:
            return None
        return Group(self.api_version, self.kind, self.plural, metadata.get("namespace", ""), name, uid)

    def index_of(self, pod: Mapping[str, Any]) -> int | None:
        return annotation_index(pod, COMPLETION_INDEX)

    def index_field(self) -> FieldPath:
        return annotation_field(COMPLETION_INDEX)

    def expected_size(self, owner: Mapping[str, Any]) -> int | None:
        return _positive(((owner.get("spec") or {}).get("trainer") or {}).get("numNodes"))

    def referred_size(self, kube: kubernetes.client.ApiClient, owner: Mapping[str, Any]) -> int | None:
        """The training nodes the TrainJob's runtime gives it (``runtime_nodes``), None when the runtime
        cannot be read (said in the log). Blocking."""
        metadata = owner.get("metadata") or {}
        try:
            runtime = read_runtime(kube, owner)
        except ApiException as error:
            log.warning("TrainJob %s/%s: its runtime is not readable (HTTP %s): its size is unknown",
                        metadata.get("namespace"), metadata.get("name"), error.status)  # fmt: skip
            return None
        return runtime_nodes(runtime) if runtime is not None else None

    def pod_selector(self, group: Group) -> str:
        return f"{jobset.NAME_LABEL}={group.name}"

    def token_secret_name(self, name: str) -> str:
        return api.kind_token_secret_name(self.key, name)

    def member_pods(self, kube: kubernetes.client.ApiClient, group: Group) -> list[dict[str, Any]]:
        found = controlled_jobset(kube, group.namespace, group.name, group.uid)
        if found is None:
            return []
        owned = str(found["metadata"]["uid"])
        jobs = kubernetes.client.BatchV1Api(kube).list_namespaced_job(
            group.namespace, label_selector=f"{jobset.UID_LABEL}={owned}"
        )
        children = frozenset(job.metadata.uid for job in jobs.items if _training_job_of(job, owned))
        return pods_claimed(kube, self, group, children)


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def runtime_nodes(runtime: Mapping[str, Any]) -> int | None:
    """The training nodes a (Cluster)TrainingRuntime gives a TrainJob that does not name its own, as the
    Trainer counts them (``core/trainingruntime.go`` newRuntimeInfo): ``mlPolicy.numNodes``, 1 when the
    mlPolicy leaves it out; None without an mlPolicy or with a value that is not a positive whole number."""
    policy = (runtime.get("spec") or {}).get("mlPolicy") if isinstance(runtime, Mapping) else None
    if not isinstance(policy, Mapping):
        return None
    return _positive(policy.get("numNodes", 1))


def _runtime_ref(trainjob: Mapping[str, Any]) -> tuple[str, str] | None:
    """(kind, name) of the runtime the TrainJob names, None when it is not one of the Trainer's."""
    ref = (trainjob.get("spec") or {}).get("runtimeRef") or {}
    kind, name, api_group = ref.get("kind") or DEFAULT_RUNTIME_KIND, ref.get("name"), API_VERSION.split("/")[0]
    if ref.get("apiGroup", api_group) != api_group or kind not in RUNTIME_PLURALS:
        return None
    return (kind, name) if isinstance(name, str) and name else None


def read_runtime(kube: kubernetes.client.ApiClient, trainjob: Mapping[str, Any]) -> dict[str, Any] | None:
    """The runtime the Trainer builds ``trainjob`` from: the snapshot it keeps for it (a ConfigMap the
    TrainJob controls, its runtime of the kind and name ``runtimeRef`` says, as the Trainer checks it),
    else, before Trainer v2.3 made snapshots, the runtime ``runtimeRef`` names. None when there is none
    or the snapshot is not one. Blocking; raises ApiException when a read fails otherwise than 404."""
    metadata = trainjob.get("metadata") or {}
    namespace, name, uid = metadata.get("namespace", ""), metadata.get("name", ""), metadata.get("uid")
    ref = _runtime_ref(trainjob)
    if ref is None or not name:
        return None
    try:
        snapshot = kubernetes.client.CoreV1Api(kube).read_namespaced_config_map(name + SNAPSHOT_SUFFIX, namespace)
    except ApiException as error:
        if error.status != 404:
            raise
        snapshot = None
    if snapshot is not None:
        controller = next((o for o in snapshot.metadata.owner_references or [] if o.controller), None)
        if controller is None or controller.uid != uid:
            return None  # the Trainer refuses it too
        try:
            runtime = yaml.safe_load((snapshot.data or {}).get(SNAPSHOT_KEY) or "")
        except yaml.YAMLError:
            return None
        if not isinstance(runtime, dict) or (runtime.get("kind"), (runtime.get("metadata") or {}).get("name")) != ref:
            return None
        return runtime
    kind, runtime_name = ref
    objects, group, version = kubernetes.client.CustomObjectsApi(kube), *API_VERSION.split("/")
    try:
        if kind == DEFAULT_RUNTIME_KIND:
            return objects.get_cluster_custom_object(group, version, RUNTIME_PLURALS[kind], runtime_name)
        return objects.get_namespaced_custom_object(group, version, namespace, RUNTIME_PLURALS[kind], runtime_name)
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def _training_job_of(job: kubernetes.client.V1Job, jobset_uid: str) -> bool:
    """A Job the JobSet controls that runs training nodes (not a dataset or model initializer)."""
    references = job.metadata.owner_references or []
    if not any(o.controller and o.kind == "JobSet" and o.uid == jobset_uid for o in references):
        return False
    return (job.metadata.labels or {}).get(ANCESTOR_LABEL, TRAINER_ANCESTOR) == TRAINER_ANCESTOR


def controlled_jobset(
    kube: kubernetes.client.ApiClient, namespace: str, name: str, trainjob_uid: str
) -> dict[str, Any] | None:
    """JobSet ``namespace/name`` as stored when the TrainJob of its name and uid ``trainjob_uid`` controls
    it, else None. Blocking."""
    found = _read_jobset(kube, namespace, name)
    owner = _controlling_trainjob(found)
    if found is None or owner is None or owner.get("uid") != trainjob_uid:
        return None
    return found if (found.get("metadata") or {}).get("uid") else None


def _read_jobset(kube: kubernetes.client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    api_group, _, version = jobset.API_VERSION.rpartition("/")
    try:
        return kubernetes.client.CustomObjectsApi(kube).get_namespaced_custom_object(
            api_group, version, namespace, "jobsets", name
        )
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def _controlling_trainjob(found: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if found is None:
        return None
    metadata = found.get("metadata") or {}
    owner = owned_by(found, API_VERSION, "TrainJob")
    return owner if owner is not None and owner.get("name") == metadata.get("name") and owner.get("uid") else None


def jobset_owner(kube: kubernetes.client.ApiClient, namespace: str, name: str) -> tuple[str, str | None] | None:
    """(uid of JobSet ``namespace/name``, uid of the TrainJob controlling it or None), None when no JobSet
    of that name exists. Blocking; raises ApiException when it cannot be read."""
    found = _read_jobset(kube, namespace, name)
    uid = ((found or {}).get("metadata") or {}).get("uid")
    if found is None or not uid:
        return None
    owner = _controlling_trainjob(found)
    return str(uid), (str(owner["uid"]) if owner is not None else None)


def trainjob_uid(kube: kubernetes.client.ApiClient, pod: Mapping[str, Any]) -> str | None:
    """The uid of the TrainJob controlling the JobSet ``pod``'s labels name (that JobSet, by name and
    uid), None when the pod is not a JobSet's or no TrainJob controls it. Blocking; raises ApiException
    when the JobSet cannot be read."""
    metadata = pod.get("metadata", {})
    labels = metadata.get("labels") or {}
    name, uid = labels.get(jobset.NAME_LABEL), labels.get(jobset.UID_LABEL)
    if not name or not uid:
        return None
    found = jobset_owner(kube, metadata.get("namespace", ""), name)
    return found[1] if found is not None and found[0] == uid else None


def marked(pod: Mapping[str, Any], trainjob_uid: str | None) -> dict[str, Any]:
    """A copy of ``pod`` whose ``rankwatch.io/trainjob-uid`` is ``trainjob_uid`` (None: absent), whatever
    the pod's creator wrote there."""
    metadata = dict(pod.get("metadata") or {})
    annotations = {k: v for k, v in (metadata.get("annotations") or {}).items() if k != TRAINJOB_UID_ANNOTATION}
    if trainjob_uid:
        annotations[TRAINJOB_UID_ANNOTATION] = trainjob_uid
    return {**pod, "metadata": {**metadata, "annotations": annotations}}


TRAINJOB = TrainJobAdapter()
