"""The environment variables of a traced pod's sidecar, named once: the operator's pod builder sets them
(``operator/lifecycle/pod_spec.py``) and the sidecar reads them (``sidecar/config.py``), so a rename on
one side cannot leave the other reading a variable nobody sets."""

from __future__ import annotations

TRACE_DIR = "RANKWATCH_TRACE_DIR"
COLLECTOR_URL = "RANKWATCH_COLLECTOR_URL"
TOKEN_FILE = "RANKWATCH_TOKEN_FILE"
JOB_NAMESPACE = "RANKWATCH_JOB_NAMESPACE"
JOB_NAME = "RANKWATCH_JOB_NAME"
"""The group's name as the collector knows it (a TrainingJob's name, or ``<Kind>:<name>``)."""
POD_NAME = "POD_NAME"
NODE_NAME = "NODE_NAME"
REPLICA_INDEX = "RANKWATCH_REPLICA_INDEX"
NPROC_PER_NODE = "RANKWATCH_NPROC_PER_NODE"
SENSITIVITY_SECONDS = "RANKWATCH_SENSITIVITY_SECONDS"
WINDOW_SECONDS = "RANKWATCH_WINDOW_SECONDS"
METRICS_PORT = "RANKWATCH_METRICS_PORT"
PYTHON_STACKS = "RANKWATCH_PYTHON_STACKS"
"""Read by the sidecar, not set by the pod builder: stacks and profiles are on unless a sidecar run by
hand turns them off."""

NOT_SET_BY_THE_OPERATOR = frozenset({PYTHON_STACKS})
