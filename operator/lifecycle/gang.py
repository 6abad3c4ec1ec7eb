"""Gang admission by Kueue: a TrainingJob in a Kueue queue is admitted whole, or not at all.

A job joins a queue with Kueue's own label, ``kueue.x-k8s.io/queue-name``, on the TrainingJob (or on
``spec.template.metadata``). Its worker pods then form one Kueue *pod group* (Kueue's plain-pod
integration): every pod carries the group's name and size, Kueue's admission webhook gates each pod
as it is made, and Kueue lifts the gates only once the ClusterQueue has quota for all of them. A pod
left with only the queue label would be a workload of its own, admitted one by one: the group labels
are what make it a gang.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
POD_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
POD_GROUP_TOTAL_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
RETRIABLE_IN_GROUP_ANNOTATION = "kueue.x-k8s.io/retriable-in-group"
"""``"false"`` on rankwatch's workers: Kueue never waits for a replacement pod in the group. rankwatch
itself replaces a failed attempt with a new group (or suspends), and only then does Kueue see the old
group finished once its pods have ended, release their finalizers and give its quota back."""
LABEL_VALUE_MAX_CHARS = 63


def queue_name(job: Mapping[str, Any]) -> str:
    """The Kueue LocalQueue the job asks for ("" when none): the job's label, else its template's."""
    labels = (job.get("metadata") or {}).get("labels") or {}
    template_labels = (((job.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels") or {}
    return str(labels.get(QUEUE_LABEL) or template_labels.get(QUEUE_LABEL) or "")


def pod_group_name(job_name: str, attempt: int, generation: int) -> str:
    """One group per attempt and per spec generation: a restart or a resume is a new gang for Kueue
    (the old group's Workload goes with its pods), never a late member of a finished one."""
    name = f"{job_name}-a{attempt}-g{generation}"
    if len(name) <= LABEL_VALUE_MAX_CHARS:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    return f"{job_name[: LABEL_VALUE_MAX_CHARS - len(digest) - 1]}-{digest}"


def gang_metadata(job: Mapping[str, Any], replicas: int, attempt: int) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) that make the job's worker pods one Kueue pod group; empty when the job
    is in no queue."""
    queue = queue_name(job)
    if not queue:
        return {}, {}
    metadata = job["metadata"]
    group = pod_group_name(metadata["name"], attempt, int(metadata.get("generation") or 1))
    return (
        {QUEUE_LABEL: queue, POD_GROUP_LABEL: group},
        {POD_GROUP_TOTAL_COUNT_ANNOTATION: str(replicas), RETRIABLE_IN_GROUP_ANNOTATION: "false"},
    )
