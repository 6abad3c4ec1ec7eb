"""spec.suspend on a real cluster: a suspended job holds no pods; suspending deletes them, resuming
makes them again, and the job says which it is."""

from __future__ import annotations

import kubernetes
import pytest
from trainingjobs import create_job, get_job, phase_is, small_job, worker_pods

pytestmark = pytest.mark.e2e


def set_suspend(api, namespace: str, name: str, suspend: bool) -> None:
    kubernetes.client.CustomObjectsApi(api).patch_namespaced_custom_object(
        "rankwatch.io", "v1alpha1", namespace, "trainingjobs", name, {"spec": {"suspend": suspend}}
    )


def conditions(api, namespace: str, name: str) -> dict[str, dict]:
    return {c["type"]: c for c in get_job(api, namespace, name)["status"]["conditions"]}


def test_a_job_created_suspended_makes_no_pods_until_resumed(api, kubectl, namespace, eventually):
    manifest = small_job("held")
    manifest["spec"]["suspend"] = True
    create_job(api, namespace, manifest)
    status = eventually(lambda: phase_is(api, namespace, "held", "Suspended"), 60, what="job Suspended")
    # The operator writes the first status after it has made the job's children: no pod among them.
    assert worker_pods(api, namespace, "held") == []
    assert status["workers"] == "0/2"
    assert conditions(api, namespace, "held")["Suspended"]["status"] == "True"
    kubernetes.client.CoreV1Api(api).read_namespaced_service("held", namespace)  # the rest is there

    set_suspend(api, namespace, "held", False)
    status = eventually(lambda: phase_is(api, namespace, "held", "Running"), 60, what="job Running after resume")
    assert status["workers"] == "2/2"
    assert conditions(api, namespace, "held")["Suspended"]["status"] == "False"


def test_suspending_a_running_job_deletes_its_pods_and_resuming_makes_them_again(api, kubectl, namespace, eventually):
    create_job(api, namespace, small_job("pausable"))
    eventually(lambda: phase_is(api, namespace, "pausable", "Running"), 60, what="job Running")
    assert len(worker_pods(api, namespace, "pausable")) == 2

    set_suspend(api, namespace, "pausable", True)
    eventually(lambda: not worker_pods(api, namespace, "pausable"), 60, what="worker pods deleted")
    status = eventually(
        lambda: (s := phase_is(api, namespace, "pausable", "Suspended")) and "no worker pods" in s["message"] and s,
        60,
        what="job Suspended with no pods",
    )
    assert status["reason"] == "Suspended", "losing workers to a suspend is no failure"
    row = kubectl("get", "tj", "pausable", "-n", namespace, "--no-headers").stdout.split()
    assert row[:3] == ["pausable", "Suspended", "Suspended"]
    reasons = [e.reason for e in kubernetes.client.CoreV1Api(api).list_namespaced_event(namespace).items]
    assert "Suspending" in reasons

    set_suspend(api, namespace, "pausable", False)
    status = eventually(lambda: phase_is(api, namespace, "pausable", "Running"), 60, what="job Running again")
    assert status["workers"] == "2/2" and len(worker_pods(api, namespace, "pausable")) == 2
