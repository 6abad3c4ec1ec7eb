"""Names of the TrainingJob API and the labels/annotations rankwatch puts on what it creates."""

GROUP = "rankwatch.io"
VERSION = "v1alpha1"
PLURAL = "trainingjobs"
KIND = "TrainingJob"
API_VERSION = f"{GROUP}/{VERSION}"

JOB_NAME_LABEL = "rankwatch.io/job-name"
REPLICA_INDEX_LABEL = "rankwatch.io/replica-index"
ATTEMPT_LABEL = "rankwatch.io/attempt"
"""On worker pods: the attempt they belong to (0, then 1 after the first restart, ...)."""
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "rankwatch"
TRACING_ANNOTATION = "rankwatch.io/tracing"
TRACED_LABEL = "rankwatch.io/traced"
"""On every pod that carries rankwatch's sidecar (a TrainingJob's with tracing on, or one the webhook
injected), value ``true``: the chart's NetworkPolicies let such pods reach the collector, and the operator
reach their sidecar's port, by it (a pod of another kind has no ``rankwatch.io/job-name``)."""

TOKEN_KEY = "token"


def worker_pod_name(job_name: str, index: int, attempt: int = 0) -> str:
    """``<job>-worker-<i>`` for the first attempt, ``<job>-r<n>-worker-<i>`` after the n-th restart: a
    new attempt's workers (and so worker 0's host name, the rendezvous address) never collide with the
    old ones still terminating. Fits 63 characters for names of 45 and up to 99 restarts."""
    return f"{job_name}-worker-{index}" if attempt == 0 else f"{job_name}-r{attempt}-worker-{index}"


def service_name(job_name: str) -> str:
    return job_name


def token_secret_name(job_name: str) -> str:
    return f"{job_name}-rankwatch-token"


def group_collector_name(kind: str, name: str) -> str:
    """How the sidecars of a group of another kind and the collector name it (``RANKWATCH_JOB_NAME``):
    ``<Kind>:<name>``, never a TrainingJob's name (object names have no capitals and no colon)."""
    return f"{kind}:{name}"


GROUP_TOKEN_SUFFIXES = {
    "Job": "job",
    "JobSet": "jobset",
    "VolcanoJob": "vcjob",
    "TrainJob": "trainjob",
    "PyTorchJob": "pytorchjob",
}
"""The kinds of groups rankwatch follows (as it names them) and their token Secrets' suffixes."""


def group_token_secret_name(kind_key: str, name: str) -> str | None:
    """``<name>-rankwatch-<suffix>-token``: the token Secret of a group of another kind, never a
    TrainingJob's (``<name>-rankwatch-token``) nor another kind's; None for a kind rankwatch does not follow."""
    return kind_token_secret_name(kind_key, name) if kind_key in GROUP_TOKEN_SUFFIXES else None


def kind_token_secret_name(kind_key: str, name: str) -> str:
    """:func:`group_token_secret_name` of a kind rankwatch follows (an adapter's)."""
    return f"{name}-rankwatch-{GROUP_TOKEN_SUFFIXES[kind_key]}-token"


def split_collector_name(name: str) -> tuple[str, str] | None:
    """(kind, object name) of a group's collector name; None for a TrainingJob's (a plain object name)."""
    kind, separator, object_name = name.partition(":")
    return (kind, object_name) if separator and kind and object_name else None


# Pods of other kinds (a plain Indexed Job, ...) opt in to the admission webhook's injection (``kinds/``).
INJECT_NAMESPACE_LABEL = "rankwatch.io/inject"
"""On a namespace, value ``enabled``: the webhook looks at its pods (the chart's namespaceSelector)."""
INJECT_NAMESPACE_VALUE = "enabled"
INJECT_ANNOTATION = "rankwatch.io/inject"
"""On a pod (its template), value ``true``: inject the tracing library and the sidecar."""
OPT_OUT_ANNOTATION = "rankwatch.io/opt-out"
"""On a pod, value ``true``: never inject, whatever else says so (a platform-wide default, say)."""
NPROC_ANNOTATION = "rankwatch.io/nproc-per-node"
"""On a pod, optional: the ranks it runs (torchrun's --nproc-per-node), for the sidecar's completeness check."""
NOT_INJECTED_ANNOTATION = "rankwatch.io/not-injected"
"""Set by the webhook on an opted-in pod it could not inject: why (reported on the pod's group)."""
UNWATCHED_ANNOTATION = "rankwatch.io/unwatched-pods"
"""On the object owning a group: how many of its opted-in pods run without the injection."""
SENSITIVITY_ANNOTATION = "rankwatch.io/sensitivity-seconds"
"""On a pod, optional: as a TrainingJob's ``spec.tracing.sensitivitySeconds`` (a rank stalled this long is hung)."""
WINDOW_ANNOTATION = "rankwatch.io/window-seconds"
"""On a pod, optional: as ``spec.tracing.windowSeconds`` (how often the sidecar summarises)."""
TENSOR_ANNOTATION = "rankwatch.io/tensor-parallel"
PIPELINE_ANNOTATION = "rankwatch.io/pipeline-parallel"
"""On a pod, optional: the job's layout, as ``spec.parallelism`` (default: data parallel only)."""
REMEDIATION_ANNOTATION = "rankwatch.io/remediation"
"""On a pod, optional: ``cordon`` (the default), ``dry-run`` or ``off``, as ``spec.remediation``."""
DIAGNOSIS_ANNOTATION = "rankwatch.io/diagnosis"
"""On the object owning a group: its diagnosis as JSON (what a TrainingJob keeps in ``status.diagnosis``)."""
