"""Build the objects a TrainingJob owns: worker Pods, the headless Service, the token Secret; and the
tracing injection itself, which the admission webhook applies to pods of other kinds (``kinds/``).

Pure functions of (job, config): no API calls, so every injected field is unit-tested. A worker
pod is the user's template plus
- torchrun rendezvous env (MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK, NPROC_PER_NODE,
  WORLD_SIZE, and the PET_* spellings torchrun reads for its own arguments), and, with tracing on,
  the injection (:func:`inject_tracing`, the same for every kind):
- an init container copying the tracing library from the rankwatch image into an emptyDir,
- LD_PRELOAD and RANKWATCH_* env on every user container (and PyTorch flight-recorder env),
- the sidecar as a native sidecar (init container with restartPolicy Always, so a finished
  trainer still completes the pod), sharing the trace volume and holding the job's token.
Ranks are not injected: the library reads torchrun's RANK, LOCAL_RANK and WORLD_SIZE in each process.
"""

from __future__ import annotations

import copy
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rankwatch import sidecar_env
from rankwatch.operator import api
from rankwatch.operator.config import WorkerPodSettings
from rankwatch.operator.lifecycle import gang
from rankwatch.operator.remediation.node_marks import TAINT_EFFECT, TAINT_KEY
from rankwatch.operator.spec import InvalidSpec, Tracing, TrainingJobSpec

LIB_VOLUME = "rankwatch-lib"
TRACE_VOLUME = "rankwatch-traces"
TOKEN_VOLUME = "rankwatch-token"
LIB_DIR = "/rankwatch/lib"
TRACE_DIR = "/rankwatch/traces"
TOKEN_DIR = "/var/run/secrets/rankwatch"
TOKEN_FILE_MODE = 0o440
"""Owner root, group root: the sidecar reads it through its group (runAsGroup 0, a non-root user); other
users (a trainer reaching into the sidecar's filesystem through the shared process namespace) cannot."""
NO_API_TOKEN_VOLUME = "rankwatch-no-api-token"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
LIBRARY_IN_IMAGE = "/opt/rankwatch/lib/librankwatch-nccl.so"
LIBRARY = f"{LIB_DIR}/librankwatch-nccl.so"
INIT_CONTAINER = "rankwatch-init"
SIDECAR_CONTAINER = "rankwatch-sidecar"
FLIGHT_RECORDER_ENTRIES = 2000

# Set by rankwatch on user containers; a template that sets one of these is refused rather than
# silently overridden. LD_PRELOAD is the exception: the user's value is kept after ours.
RENDEZVOUS_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "NNODES",
    "NODE_RANK",
    "NPROC_PER_NODE",
    "WORLD_SIZE",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
    "PET_NNODES",
    "PET_NODE_RANK",
    "PET_NPROC_PER_NODE",
    "RANKWATCH_ATTEMPT",
)


SIDECAR_METRICS_PORT_NAME = "rw-metrics"
"""The sidecar's /metrics port: the chart's PodMonitor and the local Prometheus select it by this name."""

RESERVED_CONTAINERS = (INIT_CONTAINER, SIDECAR_CONTAINER)
RESERVED_VOLUMES = (LIB_VOLUME, TRACE_VOLUME, TOKEN_VOLUME, NO_API_TOKEN_VOLUME)


@dataclass(frozen=True)
class FieldPath:
    """A downward-API field of the pod (``metadata.annotations['x']``): the kubelet fills the value in,
    for what is known only once the pod exists (an Indexed Job's completion index)."""

    path: str


@dataclass(frozen=True)
class PodTracing:
    """What the injection needs to know of the group a pod belongs to (a TrainingJob, an Indexed Job...)."""

    owner: str
    """How errors name the pod's owner: ``TrainingJob team-a/llama``."""
    group: str
    """The group's name as the collector knows it (``RANKWATCH_JOB_NAME``)."""
    namespace: str
    replica_index: int | FieldPath
    nproc_per_node: int
    """Ranks the pod runs; 0 when unknown (the sidecar then counts the rings that appear)."""
    tracing: Tracing
    token_secret: str
    token_optional: bool = False
    """True where the Secret may not exist yet when the pod starts (made at admission): the pod starts
    anyway and the kubelet fills the token in once the Secret exists."""
    ptrace: bool = False
    """The sidecar gets SYS_PTRACE (``spec.sidecar.ptrace``): py-spy reads the ranks' Python."""


def _env(name: str, value: Any) -> dict[str, str]:
    return {"name": name, "value": str(value)}


def _owner_reference(job: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "name": job["metadata"]["name"],
        "uid": job["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def job_labels(job_name: str) -> dict[str, str]:
    return {api.JOB_NAME_LABEL: job_name, api.MANAGED_BY_LABEL: api.MANAGED_BY}


def master_address(job_name: str, namespace: str, attempt: int = 0) -> str:
    """Worker 0's DNS name through the headless Service; new with every attempt (a new rendezvous)."""
    return f"{api.worker_pod_name(job_name, 0, attempt)}.{api.service_name(job_name)}.{namespace}.svc"


def rendezvous_env(
    job_name: str, namespace: str, spec: TrainingJobSpec, index: int, attempt: int = 0
) -> list[dict[str, str]]:
    address = master_address(job_name, namespace, attempt)
    values = {
        "MASTER_ADDR": address,
        "MASTER_PORT": spec.masterPort,
        "NNODES": spec.replicas,
        "NODE_RANK": index,
        "NPROC_PER_NODE": spec.nprocPerNode,
        "WORLD_SIZE": spec.world_size,
    }
    env = [_env(name, value) for name, value in values.items()]
    env += [
        _env(f"PET_{name}", values[name])
        for name in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "NPROC_PER_NODE")
    ]
    # The attempt, for a training script that resumes from its last checkpoint after a restart
    # (torchrun's TORCHELASTIC_RESTART_COUNT counts only its own restarts inside one pod).
    env.append(_env("RANKWATCH_ATTEMPT", attempt))
    return env


def tracing_env(job_name: str, tracing: Tracing) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        _env("RANKWATCH_TRACE_DIR", TRACE_DIR),
        # Rings record the node, not the pod's host name, so a diagnosis can name the machine.
        {"name": "RANKWATCH_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        _env("RANKWATCH_JOB_NAME", job_name),
        _env("RANKWATCH_GPU_TIMING", int(tracing.gpuTiming)),
        _env("RANKWATCH_SENSITIVITY_SECONDS", tracing.sensitivitySeconds),
    ]
    if tracing.flightRecorder:
        prefix = f"{TRACE_DIR}/flight_recorder_rank_"
        # Both spellings: PyTorch renamed TORCH_NCCL_* to TORCH_FR_* and still reads the old ones.
        env += [
            _env("TORCH_NCCL_TRACE_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES),
            _env("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES),
            _env("TORCH_NCCL_DUMP_ON_TIMEOUT", 1),
            _env("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", prefix),
            _env("TORCH_FR_DUMP_TEMP_FILE", prefix),
        ]
    return env


def _inject_user_container(
    container: dict[str, Any], owner: str, injected_env: list[dict[str, Any]], tracing: bool
) -> None:
    env = container.setdefault("env", [])
    reserved = {item["name"] for item in injected_env} - {"LD_PRELOAD"}
    for item in env:
        if item.get("name") in reserved:
            raise InvalidSpec(
                f"{owner}: container {container['name']!r} sets {item['name']}, which rankwatch "
                "manages; remove it from the pod template"
            )
    if tracing:
        user_preload = next((item for item in env if item.get("name") == "LD_PRELOAD"), None)
        if user_preload is not None:
            if "valueFrom" in user_preload:
                raise InvalidSpec(
                    f"{owner}: container {container['name']!r} takes LD_PRELOAD from valueFrom; "
                    "rankwatch must prepend its tracing library, so give it as a plain value"
                )
            env.remove(user_preload)
            preload = f"{LIBRARY}:{user_preload['value']}" if user_preload.get("value") else LIBRARY
        else:
            preload = LIBRARY
        injected_env = [*injected_env, _env("LD_PRELOAD", preload)]
        mounts = container.setdefault("volumeMounts", [])
        mounts.append({"name": LIB_VOLUME, "mountPath": LIB_DIR, "readOnly": True})
        mounts.append({"name": TRACE_VOLUME, "mountPath": TRACE_DIR})
    env.extend(injected_env)


def _init_container(config: WorkerPodSettings) -> dict[str, Any]:
    return {
        "name": INIT_CONTAINER,
        "image": config.image,
        "command": ["cp", LIBRARY_IN_IMAGE, LIBRARY],
        "volumeMounts": [{"name": LIB_VOLUME, "mountPath": LIB_DIR}],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
        "securityContext": _restricted_security_context(),
    }


def _sidecar_container(target: PodTracing, config: WorkerPodSettings) -> dict[str, Any]:
    field_env = [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
        for name, path in ((sidecar_env.POD_NAME, "metadata.name"), (sidecar_env.NODE_NAME, "spec.nodeName"))
    ]
    index = target.replica_index
    replica_index = (
        {"name": sidecar_env.REPLICA_INDEX, "valueFrom": {"fieldRef": {"fieldPath": index.path}}}
        if isinstance(index, FieldPath)
        else _env(sidecar_env.REPLICA_INDEX, index)
    )
    return {
        "name": SIDECAR_CONTAINER,
        "image": config.image,
        "restartPolicy": "Always",  # native sidecar: runs beside the trainer, never keeps the pod alive
        "command": ["rankwatch", "sidecar"],
        "env": [
            _env(sidecar_env.TRACE_DIR, TRACE_DIR),
            _env(sidecar_env.COLLECTOR_URL, config.collector_url),
            _env(sidecar_env.TOKEN_FILE, f"{TOKEN_DIR}/{api.TOKEN_KEY}"),
            _env(sidecar_env.JOB_NAME, target.group),
            _env(sidecar_env.JOB_NAMESPACE, target.namespace),
            replica_index,
            _env(sidecar_env.NPROC_PER_NODE, target.nproc_per_node),
            _env(sidecar_env.SENSITIVITY_SECONDS, target.tracing.sensitivitySeconds),
            _env(sidecar_env.WINDOW_SECONDS, target.tracing.windowSeconds),
            _env(sidecar_env.METRICS_PORT, config.sidecar_metrics_port),
            *field_env,
        ],
        "ports": [{"name": SIDECAR_METRICS_PORT_NAME, "containerPort": config.sidecar_metrics_port, "protocol": "TCP"}],
        "volumeMounts": [
            {"name": TRACE_VOLUME, "mountPath": TRACE_DIR},
            {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True},
            # The sidecar never calls the Kubernetes API: an empty directory hides the pod's service-account
            # token from it even when the template mounts one for the trainer.
            {"name": NO_API_TOKEN_VOLUME, "mountPath": SERVICE_ACCOUNT_DIR, "readOnly": True},
        ],
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": _ptrace_security_context()
        if target.ptrace
        else {**_restricted_security_context(), "runAsGroup": 0},
    }


def _ptrace_security_context() -> dict[str, Any]:
    """SYS_PTRACE and nothing else, as root: Kubernetes puts an added capability into the effective set of
    a root container only, and the kernel's Yama ptrace_scope 1 (the usual default) wants the capability
    to read a process that is not a child, whatever its user."""
    return {
        **_restricted_security_context(),
        "runAsNonRoot": False,
        "runAsUser": 0,
        "runAsGroup": 0,
        "capabilities": {"drop": ["ALL"], "add": ["SYS_PTRACE"]},
    }


def check_reserved_names(pod_spec: dict[str, Any], owner: str) -> None:
    """Refuse a pod spec that already uses a container or volume name the injection adds."""
    for container in pod_spec.get("initContainers", []) + pod_spec.get("containers", []):
        if container.get("name") in RESERVED_CONTAINERS:
            raise InvalidSpec(f"{owner}: container name {container['name']!r} is reserved for rankwatch")
    for volume in pod_spec.get("volumes", []):
        if volume.get("name") in RESERVED_VOLUMES:
            raise InvalidSpec(f"{owner}: volume name {volume['name']!r} is reserved for rankwatch")


def inject_tracing(
    pod_spec: dict[str, Any], target: PodTracing, config: WorkerPodSettings, env: Sequence[dict[str, Any]] = ()
) -> None:
    """Add the tracing library, its env (after ``env``, the owner's own), the sidecar and their volumes
    to ``pod_spec`` in place. Raises :class:`InvalidSpec` (naming ``target.owner``) when the spec already
    uses a name rankwatch manages; then ``pod_spec`` may be half changed: inject into a copy."""
    check_reserved_names(pod_spec, target.owner)
    injected = [*env, *tracing_env(target.group, target.tracing)]
    for container in pod_spec["containers"]:
        _inject_user_container(container, target.owner, injected, tracing=True)
    # The sidecar tells a live rank from a dead one by its pid in /proc: it must see the trainer's.
    pod_spec["shareProcessNamespace"] = True
    pod_spec["initContainers"] = [
        _init_container(config),
        _sidecar_container(target, config),
        *pod_spec.get("initContainers", []),
    ]
    token: dict[str, Any] = {"secretName": target.token_secret, "defaultMode": TOKEN_FILE_MODE}
    if target.token_optional:
        token["optional"] = True
    pod_spec.setdefault("volumes", []).extend(
        [
            {"name": LIB_VOLUME, "emptyDir": {"sizeLimit": "64Mi"}},
            {"name": TRACE_VOLUME, "emptyDir": {"sizeLimit": "2Gi"}},
            {"name": TOKEN_VOLUME, "secret": token},
            {"name": NO_API_TOKEN_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        ]
    )
    _add_pull_secrets(pod_spec, [*config.image_pull_secrets, *target.tracing.imagePullSecrets])


def _restricted_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _add_pull_secrets(pod_spec: dict[str, Any], names: list[str]) -> None:
    """The Secrets that pull rankwatch's image, after the template's own (imagePullSecrets is per pod)."""
    present = {reference.get("name") for reference in pod_spec.get("imagePullSecrets", [])}
    for name in dict.fromkeys(names):
        if name not in present:
            pod_spec.setdefault("imagePullSecrets", []).append({"name": name})


def avoid_nodes_affinity(nodes: list[str]) -> dict[str, Any]:
    """A required node anti-affinity requirement for ``nodes`` (suspects that were not cordoned)."""
    return {"key": "metadata.name", "operator": "NotIn", "values": sorted(nodes)}


def _avoid(pod_spec: dict[str, Any], nodes: list[str]) -> None:
    """Add the anti-affinity to every required term of the template (terms are ORed, so each needs it)."""
    if not nodes:
        return
    required = (
        pod_spec.setdefault("affinity", {})
        .setdefault("nodeAffinity", {})
        .setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    )
    terms = required.get("nodeSelectorTerms") or [{}]
    for term in terms:
        term["matchFields"] = [*term.get("matchFields", []), avoid_nodes_affinity(nodes)]
    required["nodeSelectorTerms"] = terms


def worker_pod(
    job: dict[str, Any],
    spec: TrainingJobSpec,
    index: int,
    config: WorkerPodSettings,
    attempt: int = 0,
    avoid_nodes: list[str] | None = None,
) -> dict[str, Any]:
    """The Pod of worker ``index`` (0-based, = NODE_RANK) of ``job`` in ``attempt``, kept off
    ``avoid_nodes``."""
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    job_id = f"{namespace}/{name}"
    template = copy.deepcopy(spec.template)
    metadata = template.get("metadata") or {}
    pod_spec = template["spec"]
    tracing = spec.tracing.enabled

    if pod_spec.get("nodeName"):
        # nodeName bypasses the scheduler (cordons, taints, quotas by node pool): a job could place its
        # workers on any node, another team's included, and get that node named by its diagnosis.
        raise InvalidSpec(
            f"TrainingJob {job_id}: spec.template.spec.nodeName is not allowed (it bypasses the scheduler); "
            "use nodeSelector or affinity"
        )

    _refuse_tolerating_the_suspect_taint(pod_spec, job_id)
    if spec.sidecar.ptrace and not config.allow_ptrace:
        raise InvalidSpec(
            f"TrainingJob {job_id}: spec.sidecar.ptrace is not allowed by this operator (its admin set the chart "
            "value sidecar.allowPtrace=false); remove it: Python stacks and profiles are then left out"
        )
    injected = rendezvous_env(name, namespace, spec, index, attempt)
    if tracing:
        target = PodTracing(
            owner=f"TrainingJob {job_id}",
            group=name,
            namespace=namespace,
            replica_index=index,
            nproc_per_node=spec.nprocPerNode,
            tracing=spec.tracing,
            token_secret=api.token_secret_name(name),
            ptrace=spec.sidecar.ptrace,
        )
        inject_tracing(pod_spec, target, config, injected)
    else:
        check_reserved_names(pod_spec, f"TrainingJob {job_id}")
        for container in pod_spec["containers"]:
            _inject_user_container(container, f"TrainingJob {job_id}", injected, tracing=False)

    pod_name = api.worker_pod_name(name, index, attempt)
    pod_spec["hostname"] = pod_name
    pod_spec["subdomain"] = api.service_name(name)
    pod_spec.setdefault("restartPolicy", "Never")
    # Training rarely calls the Kubernetes API: no service-account token unless the template asks for one.
    pod_spec.setdefault("automountServiceAccountToken", False)
    _avoid(pod_spec, list(avoid_nodes or []))

    gang_labels, gang_annotations = gang.gang_metadata(job, spec.replicas, attempt)
    labels = {
        **metadata.get("labels", {}),
        **gang_labels,
        **job_labels(name),
        api.REPLICA_INDEX_LABEL: str(index),
        api.ATTEMPT_LABEL: str(attempt),
        **({api.TRACED_LABEL: "true"} if tracing else {}),
    }
    annotations = {
        **metadata.get("annotations", {}),
        **gang_annotations,
        api.TRACING_ANNOTATION: "enabled" if tracing else "disabled",
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name,
            "namespace": namespace,
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [_owner_reference(job)],
        },
        "spec": pod_spec,
    }


def tolerates_suspect_taint(toleration: dict[str, Any]) -> bool:
    """Whether ``toleration`` lets a pod onto a node rankwatch cordoned (taint ``rankwatch.io/suspect=
    <namespace>.<job>:NoSchedule``, any job's): every toleration naming the key, and a key-less ``Exists``."""
    if toleration.get("effect") not in (None, "", TAINT_EFFECT):
        return False
    key = toleration.get("key") or ""
    return key == TAINT_KEY or (not key and toleration.get("operator") == "Exists")


def _refuse_tolerating_the_suspect_taint(pod_spec: dict[str, Any], job_id: str) -> None:
    """A cordon alone does not keep out a pod that tolerates ``node.kubernetes.io/unschedulable`` (the
    scheduler lets it past): rankwatch's taint does. A template tolerating that taint too would put the
    job's workers back on its suspects, so it is refused, not silently changed."""
    for index, toleration in enumerate(pod_spec.get("tolerations") or []):
        if tolerates_suspect_taint(toleration):
            raise InvalidSpec(
                f"TrainingJob {job_id}: spec.template.spec.tolerations[{index}] tolerates rankwatch's taint "
                f"{TAINT_KEY}:{TAINT_EFFECT}, which keeps workers off the nodes rankwatch took out of scheduling; "
                "tolerate the taints you need by key"
            )


def headless_service(job: dict[str, Any], spec: TrainingJobSpec) -> dict[str, Any]:
    """The Service that gives every worker a DNS name, ready or not (rendezvous needs it early)."""
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": api.service_name(name),
            "namespace": namespace,
            "labels": job_labels(name),
            "ownerReferences": [_owner_reference(job)],
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {api.JOB_NAME_LABEL: name},
            "ports": [{"name": "rendezvous", "port": spec.masterPort, "targetPort": spec.masterPort}],
        },
    }


def token_secret(job: dict[str, Any]) -> dict[str, Any]:
    """A fresh per-job bearer token the job's sidecars present to the collector."""
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    return group_token_secret(api.token_secret_name(name), namespace, _owner_reference(job), job_labels(name))


def group_token_secret(
    secret_name: str, namespace: str, owner: dict[str, Any], labels: dict[str, str] | None = None
) -> dict[str, Any]:
    """A fresh bearer token for the sidecars of one group of pods, owned by (and so deleted with) ``owner``."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": secret_name,
            "namespace": namespace,
            "labels": {api.MANAGED_BY_LABEL: api.MANAGED_BY, **(labels or {})},
            "ownerReferences": [owner],
        },
        "stringData": {api.TOKEN_KEY: secrets.token_urlsafe(32)},
    }
