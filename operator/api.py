"""Names of the TrainingJob API and the labels/annotations rankwatch puts on what it creates."""

GROUP = "rankwatch.io"
VERSION = "v1alpha1"
PLURAL = "trainingjobs"
KIND = "TrainingJob"
API_VERSION = f"{GROUP}/{VERSION}"

JOB_NAME_LABEL = "rankwatch.io/job-name"
REPLICA_INDEX_LABEL = "rankwatch.io/replica-index"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "rankwatch"
TRACING_ANNOTATION = "rankwatch.io/tracing"

TOKEN_KEY = "token"


def worker_pod_name(job_name: str, index: int) -> str:
    return f"{job_name}-worker-{index}"


def service_name(job_name: str) -> str:
    return job_name


def token_secret_name(job_name: str) -> str:
    return f"{job_name}-rankwatch-token"
