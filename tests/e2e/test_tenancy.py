"""What a job author cannot make rankwatch do, on the real API server: end pods its TrainingJob does
not control (a pod that only carries the job's labels, which any tenant of the namespace can create),
or have the operator read a Secret that was not opted in as archive credentials."""

from __future__ import annotations

import sys
from pathlib import Path

import kubernetes
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: the remediation tests' job helpers
from test_remediation import bare_pod, create_job

from rankwatch.operator.recovery import archive, attempts

pytestmark = pytest.mark.e2e


def test_ending_an_attempt_deletes_only_the_pods_the_job_controls(api, unwatched_namespace):
    namespace = unwatched_namespace
    job = create_job(api, namespace, "llama", ["gpu-node-0", "gpu-node-1"])
    labels = {"rankwatch.io/job-name": "llama", "rankwatch.io/replica-index": "0", "rankwatch.io/attempt": "0"}
    bare_pod(api, namespace, "someone-elses-pod", "gpu-node-2", labels)

    pods = attempts.attempt_pods(api, namespace, "llama", job.job_uid)
    ended = attempts.end_pods(api, namespace, pods)

    assert sorted(ended) == ["llama-worker-0", "llama-worker-1"]
    left = kubernetes.client.CoreV1Api(api).read_namespaced_pod("someone-elses-pod", namespace)
    assert left.metadata.deletion_timestamp is None
    # A TrainingJob recreated under the same name is another job: the old one's pods are not its own.
    assert attempts.attempt_pods(api, namespace, "llama", "another-uid") == []


def test_a_secret_not_opted_in_is_not_read_as_archive_credentials(api, unwatched_namespace):
    core = kubernetes.client.CoreV1Api(api)
    keys = {"accessKeyId": "AKIAEXAMPLE", "secretAccessKey": "not-for-rankwatch"}
    core.create_namespaced_secret(unwatched_namespace, {"metadata": {"name": "team-db"}, "stringData": keys})
    labels = {archive.CREDENTIALS_LABEL: "true"}
    core.create_namespaced_secret(
        unwatched_namespace, {"metadata": {"name": "bucket", "labels": labels}, "stringData": keys}
    )

    with pytest.raises(
        archive.ArchiveFailed, match=r"team-db .* is not labelled rankwatch\.io/archive-credentials=true"
    ):
        archive.read_credentials(api, unwatched_namespace, "team-db")
    assert archive.read_credentials(api, unwatched_namespace, "bucket").access_key == "AKIAEXAMPLE"
