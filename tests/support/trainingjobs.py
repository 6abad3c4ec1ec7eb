"""The stand-in TrainingJob the e2e tests run (2 pods x 4 ranks on the stand-in NCCL, a fault on one
rank) and the reads they make of it: its status, conditions, Events, report and the nodes it marked."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import kubernetes
from prometheus_client.parser import text_string_to_metric_families

from rankwatch.model.diagnosis_status import STATUS_KEY
from rankwatch.operator.diagnosis.monitor import NO_FINDING_RETRY_S

JOB_API = ("rankwatch.io", "v1alpha1", "trainingjobs")
SENSITIVITY = 10
WINDOW = 2
ARMED_RUNS = SENSITIVITY // WINDOW + 5
"""Detector runs over a job after which every check has judged its full evidence a few times: a
sensitivity's history for a hang, three windows of waits for an outlier, a step-time baseline of six
points and three current ones (two pods: two points a window)."""
STRAGGLER = {"RANKWATCH_STANDIN_FAULT_RANK": "5", "RANKWATCH_STANDIN_SLOWDOWN": "0.5"}
"""Rank 5's GPU computes 50% longer: the GPU-timed flows' straggler. The detector suspects a rank whose
wait is at most 0.3 of its peers' (WAIT_RATIO), and the last to arrive still waits for the transfer
itself: on this 2-core machine under the suite's load rank 5 of a 30% slowdown waited 0.32 of its
peers' (292 vs 921 us), and a job went 90 s unsuspected; at 50% it waits about a fifth of theirs."""
STANDIN_DEVICE = os.environ.get("RANKWATCH_E2E_STANDIN_DEVICE", "async")
"""The stand-in GPU model of the jobs: ``async`` (NCCL calls return at once, the collectives run on the
device's streams, as on a real GPU); ``sync`` only for comparison."""


def standin_job(
    name: str,
    faults: dict[str, str] | None = None,
    gpu_timing: bool | None = None,
    remediation: dict | None = None,
    device: str | None = None,
    pipeline: int = 1,
    driver_args: tuple[str, ...] = (),
    replicas: int = 2,
    tensor: int = 4,
    gpus: bool = True,
) -> dict[str, Any]:
    """2 pods x 4 ranks, TP 4 (one TP group per pod), DP 2 (or, with ``pipeline=2``, PP 2: pod 0 the first
    stage, pod 1 the second), on the ``STANDIN_DEVICE``; faults on the rank RANKWATCH_STANDIN_FAULT_RANK names
    (``device`` overrides the device for one job; ``driver_args``: more `simulate-pod` flags). GPU timing as
    the CRD defaults it (on) unless ``gpu_timing`` says. Nodes are not cordoned unless ``remediation`` says so
    (the tests share four nodes). ``replicas`` pods of ``tensor`` ranks each (one TP group per pod), each
    asking for a GPU per rank unless ``gpus`` is off (many small jobs on the four nodes at once)."""
    env = [{"name": "RANKWATCH_STANDIN_DEVICE", "value": device or STANDIN_DEVICE}]
    env += [{"name": key, "value": value} for key, value in (faults or {}).items()]
    tracing: dict[str, Any] = {"sensitivitySeconds": SENSITIVITY, "windowSeconds": WINDOW}
    if gpu_timing is not None:
        tracing["gpuTiming"] = gpu_timing
    command = ["rankwatch", "simulate-pod", "--tp", str(tensor), "--pp", str(pipeline), "--steps", "1000000",
               *driver_args]  # fmt: skip
    trainer: dict[str, Any] = {"name": "trainer", "image": "rankwatch/rankwatch:0.1.0", "command": command, "env": env}
    if gpus:
        trainer["resources"] = {"limits": {"nvidia.com/gpu": tensor}}
    return {
        "apiVersion": "rankwatch.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "nprocPerNode": tensor,
            "parallelism": {"tensor": tensor, "pipeline": pipeline},
            "template": {"spec": {"containers": [trainer]}},
            "tracing": tracing,
            "remediation": remediation or {"cordon": False},
            # Diagnosis only: recovery's default restart after a hang would reset the conditions under test.
            "recovery": {"policy": "None"},
        },
    }


def get_job(api, namespace: str, name: str) -> dict:
    return kubernetes.client.CustomObjectsApi(api).get_namespaced_custom_object(
        *JOB_API[:2], namespace, JOB_API[2], name
    )


def create_job(api, namespace: str, manifest: dict) -> dict:
    """The TrainingJob as the API server made it."""
    return kubernetes.client.CustomObjectsApi(api).create_namespaced_custom_object(
        *JOB_API[:2], namespace, JOB_API[2], manifest
    )


def diagnosis_in(status: dict) -> dict:
    """The diagnosis record a job's ``status`` holds, as the API server stores it ({} when none): the
    tests check the stored keys themselves, as a user reading the object would."""
    return (status or {}).get(STATUS_KEY) or {}


def stored_diagnosis(job: dict) -> dict:
    """``diagnosis_in`` of a TrainingJob object."""
    return diagnosis_in(job.get("status") or {})


def condition(job: dict, type_: str) -> dict:
    return next((c for c in job.get("status", {}).get("conditions", []) if c["type"] == type_), {})


def node_of_pod(api, namespace: str, pod: str) -> str:
    return kubernetes.client.CoreV1Api(api).read_namespaced_pod(pod, namespace).spec.node_name


def events(api, namespace: str, job: str) -> list:
    items = kubernetes.client.CoreV1Api(api).list_namespaced_event(namespace).items
    return [e for e in items if e.involved_object.kind == "TrainingJob" and e.involved_object.name == job]


def wait_running(api, namespace: str, name: str, eventually) -> float:
    eventually(lambda: get_job(api, namespace, name).get("status", {}).get("phase") == "Running", 60, what="Running")
    return time.monotonic()


def diagnosed(api, namespace: str, name: str, type_: str):
    job = get_job(api, namespace, name)
    return job if condition(job, type_).get("status") == "True" else None


def report(api, namespace: str, job: dict) -> dict:
    configmap = kubernetes.client.CoreV1Api(api).read_namespaced_config_map(stored_diagnosis(job)["report"], namespace)
    assert configmap.metadata.owner_references[0].name == job["metadata"]["name"]
    return json.loads(configmap.data["report.json"])


def node_marks(api, name: str) -> tuple[bool, list[str], dict[str, str]]:
    """(unschedulable, taint keys, rankwatch annotations) of a node."""
    node = kubernetes.client.CoreV1Api(api).read_node(name)
    taints = [f"{t.key}={t.value}:{t.effect}" for t in node.spec.taints or []]
    marks = {k: v for k, v in (node.metadata.annotations or {}).items() if k.startswith("rankwatch.io/")}
    return bool(node.spec.unschedulable), taints, marks


def worker_pods(api, namespace: str, job: str) -> list:
    pods = kubernetes.client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"rankwatch.io/job-name={job}"
    )
    return sorted(pods.items, key=lambda pod: pod.metadata.name)


def phase_is(api, namespace: str, name: str, phase: str):
    status = get_job(api, namespace, name).get("status", {})
    return status if status.get("phase") == phase else None


def small_job(name: str, replicas: int = 2, annotations: dict | None = None, gpus: int = 8) -> dict:
    """A TrainingJob whose workers kwok runs (no stand-in ranks): for the lifecycle, not the diagnosis."""
    return {
        "apiVersion": "rankwatch.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "nprocPerNode": 8,
            "template": {
                "metadata": {"annotations": annotations or {}},
                "spec": {
                    "containers": [
                        {"name": "trainer", "image": "trainer:1", "resources": {"limits": {"nvidia.com/gpu": gpus}}}
                    ]
                },
            },
        },
    }


def operator_metric(metrics_url: str, sample: str, **labels: str) -> float:
    """The sum of an operator's samples named ``sample`` whose labels include ``labels`` (0 when none, or
    while nothing answers at ``metrics_url``)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return 0.0
    return sum(
        value
        for family in text_string_to_metric_families(text)
        for name, sample_labels, value, *_ in family.samples
        if name == sample and labels.items() <= sample_labels.items()
    )


def crd_established(api, name: str) -> bool:
    """Whether the CRD ``name`` is Established. Polled instead of ``kubectl wait``, which fails at once
    while the API server has not yet given a new CRD its status conditions."""
    crd = kubernetes.client.ApiextensionsV1Api(api).read_custom_resource_definition(name)
    return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])


def detector_runs(metrics_url: str, namespace: str, name: str) -> int:
    """How many times the operator's detector has judged the job's summaries."""
    return int(operator_metric(metrics_url, "rankwatch_job_detector_runs_total", namespace=namespace, trainingjob=name))


def diagnoses_in_progress(metrics_url: str) -> int:
    return int(operator_metric(metrics_url, "rankwatch_diagnoses_running")
               + operator_metric(metrics_url, "rankwatch_diagnoses_waiting"))  # fmt: skip


def turned_down(metrics_url: str) -> int:
    """Diagnoses the operator ran that found nothing: a suspicion turned down is looked at again
    NO_FINDING_RETRY_S later (a hang of a job whose sidecars answered, two windows later)."""
    return int(operator_metric(metrics_url, "rankwatch_diagnoses_total", outcome="no_finding"))


def judge(
    metrics_url: str,
    namespace: str,
    names: tuple[str, ...],
    check: Callable[[], None],
    eventually,
    runs: int,
    seen: int | None = None,
) -> None:
    """Run ``check`` (which asserts that nothing was found) until the operator's detector has judged the
    jobs ``names`` ``runs`` more times each and no diagnosis is queued or running (so a suspicion raised
    meanwhile was seen through), then once more: "nothing found" rests on that much evidence, however busy
    the machine, instead of on a fixed wait. After each diagnosis that found nothing (since ``seen`` of them,
    a ``turned_down`` taken before the jobs started) it judges a retry period's runs (and two) more: the
    second look at a suspicion the analysis turned down is judged too. Without a suspicion turned down
    there is nothing to look at again, and no retry period to wait for."""
    retry_runs = int(NO_FINDING_RETRY_S / WINDOW) + 2
    seen = turned_down(metrics_url) if seen is None else seen
    target = {name: detector_runs(metrics_url, namespace, name) + runs for name in names}

    def judged() -> bool:
        nonlocal seen
        check()
        done = {name: detector_runs(metrics_url, namespace, name) for name in names}
        if (now := turned_down(metrics_url)) > seen:
            seen = now
            target.update({name: max(target[name], done[name] + retry_runs) for name in names})
        return all(done[name] >= target[name] for name in names) and diagnoses_in_progress(metrics_url) == 0

    patience = 3 * WINDOW * (runs + 3 * retry_runs) + 60  # only how long a broken operator is waited for
    eventually(judged, patience, interval=1, what=f"the detector's runs over {names} in {namespace}")
    check()
