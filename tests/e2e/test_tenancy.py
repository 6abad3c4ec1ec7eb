"""What a job author cannot make rankwatch do, on the real API server: end pods its TrainingJob does
not control (a pod that only carries the job's labels, which any tenant of the namespace can create),
have the operator read a Secret that was not opted in as archive credentials, or get its workers onto
a node rankwatch cordoned by tolerating the cordon (the real scheduler decides)."""

from __future__ import annotations

import kubernetes
import pytest
from cordons import GPU_NODES, bare_pod, job_on_nodes, policy, reset_node, suspect

from rankwatch.operator import api as names
from rankwatch.operator.config import WorkerPodSettings
from rankwatch.operator.lifecycle import pod_spec
from rankwatch.operator.recovery import archive, attempts
from rankwatch.operator.remediation.cordon import remediate
from rankwatch.operator.spec import TrainingJobSpec

pytestmark = pytest.mark.e2e


def test_ending_an_attempt_deletes_only_the_pods_the_job_controls(api, unwatched_namespace):
    namespace = unwatched_namespace
    job = job_on_nodes(api, namespace, "llama", ["gpu-node-0", "gpu-node-1"])
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


@pytest.fixture
def nodes_as_found(api):
    """The GPU nodes without rankwatch's marks or a cordon, before and after."""
    core = kubernetes.client.CoreV1Api(api)
    for name in GPU_NODES:
        reset_node(core, name)
    yield
    for name in GPU_NODES:
        reset_node(core, name)


def test_a_template_tolerating_the_cordon_is_still_kept_off_a_node_rankwatch_cordoned(
    api, kubectl, unwatched_namespace, nodes_as_found, eventually
):
    """``node.kubernetes.io/unschedulable`` tolerated gets a pod past a plain cordon; rankwatch's taint keeps
    it off the node rankwatch cordoned (and a template tolerating that taint is refused: test_pod_spec.py)."""
    namespace, core = unwatched_namespace, kubernetes.client.CoreV1Api(api)
    request = job_on_nodes(api, namespace, "tolerant", ["gpu-node-3"])
    remediate(api, suspect(request, "gpu-node-3"), policy())
    kubectl("cordon", "gpu-node-2")  # someone else's plain cordon, no taint
    job = kubernetes.client.CustomObjectsApi(api).get_namespaced_custom_object(
        names.GROUP, names.VERSION, namespace, names.PLURAL, "tolerant"
    )
    tolerations = [{"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"}]
    placed = {}
    for index, node in ((0, "gpu-node-3"), (1, "gpu-node-2")):
        template = {"spec": {"containers": [{"name": "trainer", "image": "trainer:1"}], "tolerations": tolerations,
                             "nodeSelector": {"kubernetes.io/hostname": node}}}  # fmt: skip
        spec = TrainingJobSpec.from_manifest({"template": template, "replicas": 2, "nprocPerNode": 1})
        pod = pod_spec.worker_pod(job, spec, index, WorkerPodSettings(), attempt=1)
        placed[node] = core.create_namespaced_pod(namespace, pod).metadata.name

    def scheduling(name: str):
        conditions = core.read_namespaced_pod(name, namespace).status.conditions or []
        return next((c for c in conditions if c.type == "PodScheduled"), None)

    try:
        plain = eventually(lambda: scheduling(placed["gpu-node-2"]), 60, what="the pod beside a plain cordon")
        assert plain.status == "True", "the toleration gets it past a cordon without rankwatch's taint"
        refused = eventually(lambda: scheduling(placed["gpu-node-3"]), 60, what="the scheduler's answer")
        assert refused.status == "False" and "1 node(s) had untolerated taint" in refused.message, refused
    finally:
        kubectl("uncordon", "gpu-node-2")  # rankwatch's mark: undone by nodes_as_found
