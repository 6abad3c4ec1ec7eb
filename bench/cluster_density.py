"""Density on the local cluster: N kwok nodes, J TrainingJobs, the real operator creating every worker pod.

The local cluster (real etcd, kube-apiserver, controller-manager and scheduler; kwok as the kubelet of
every fake GPU node, see rankwatch/cluster) runs without the pod runner: worker pods exist only in
the API, the scheduler binds them and kwok marks them Running. The operator is `rankwatch operator
--standalone --namespace <step's namespace>` as a process (as tests/e2e/conftest.py starts it), under
a client certificate of its own so the API server can count its requests apart: a FlowSchema matching
that user feeds ``apiserver_flowcontrol_dispatched_requests_total{flow_schema=...}`` in the API
server's /metrics (``apiserver_request_total`` carries no user label). Its priority level is
``exempt``, so the count never throttles what it counts.

Each step (``NODES:JOBS``) sizes the node pool (``LocalCluster.up``), starts a fresh operator on a
fresh namespace, creates every job at once (``--pods-per-node`` pods per node in all: each pod asks
for ``8 / pods-per-node`` GPUs, or as big a share of the node's CPUs when that is fewer GPUs than its
``--ranks-per-pod`` nominal ranks, which the CRD refuses), waits until every job's
status phase is Running and every worker Ready (``status.workers`` N/N: kwok marks a pod Ready some
time after Running, and each readiness is a pod event and a status write), then watches the operator
idle for ``--settle`` seconds (every worker Ready, or ``--ready-wait`` seconds after all Running: a
pod kwok once let go NotReady may stay so) and stops it (the
next step deletes the namespace; the last leaves it to `cluster down`). Measured per step: each
job's time from create to Running (median, slowest), the operator's CPU (``/proc``, with its child
processes) as a share of one core while jobs start and while idle, its resident memory (now and
peak), and its API requests per second in both phases.

    RANKWATCH_CLUSTER_DIR=~/.rankwatch/density python bench/cluster_density.py [--steps 100:5,1000:50]
        [--pods-per-node 8] [--ranks-per-pod 8] [--settle 60] [--timeout 1200] [--down]
        [--sidecar-windows 13 [--senders 2] [--connections 512]]

With ``--sidecar-windows N``, once the idle figures are taken, every worker pod's sidecar is played
against the operator's own collector for N windows of 5 s (``operator_scale.send``: sender processes
of ``sidecar_load``, the real protocol, each job's token read from the Secret the operator wrote, one
window summary per real pod naming the node it is bound to; 8 ranks per pod, TP 8 x DP x PP, the jobs'
``spec.parallelism`` set to match): the diagnosis side and the API side of the operator measured
together, in one process. Measured then: summaries accepted per second against offered, refused,
unanswered, latency; the operator's CPU per window, its memory, its API requests per second (the
monitor's status writes), and the detector's time per window from its own histogram
(``rankwatch_detector_duration_seconds`` on the collector's /metrics) with the suspicions it raised
(none expected: every rank waits 0.7-1.3 ms; a suspicion would start a diagnosis that reaches for
sidecars that do not exist).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException
from operator_cpu import RANKS_PER_POD, TP
from operator_scale import (
    LOAD_COLUMNS,
    describe_senders,
    job_bodies,
    layout_of,
    load_figures,
    print_table,
    process_tree,
    send,
    tree_cpu_seconds,
    tree_rss_mib,
)
from prometheus_client.parser import text_string_to_metric_families

from rankwatch.cluster import binaries, kubeconfig, pki
from rankwatch.cluster.local import LocalCluster
from rankwatch.cluster.nodes import CPUS_PER_NODE, GPUS_PER_NODE
from rankwatch.cluster.operator_process import start_operator
from rankwatch.cluster.ports import free_port
from rankwatch.operator import api as rankwatch_api
from rankwatch.operator.diagnosis.ingest.collector import secret_token

REPO = Path(__file__).resolve().parents[1]
CRD_NAME = "trainingjobs.rankwatch.io"
CRD_PATH = REPO / "crds" / f"{CRD_NAME}.yaml"
OPERATOR = pki.ClientIdentity("density-operator", "rankwatch-density-operator")
PREFIX = "density-"  # the namespaces of the steps
FLOW_SCHEMA = "rankwatch-density-operator"
INJECTED_CPU_MILLIS = 1000
"""Room left in a pod's CPU share for the containers the operator adds to every worker pod (its native
sidecar asks for 50m, counted with the trainer's request): 8 pods asking 12 CPUs each plus that no longer
fit a node of 96, and an eighth of the pods stayed Pending with "Insufficient cpu"."""
WINDOW_S = 5
"""The played sidecars' window, also set as the jobs' ``tracing.windowSeconds`` (the CRD's default)."""
DETECTOR = "rankwatch_detector_duration_seconds"
LOOP_LAG = "rankwatch_event_loop_lag_seconds"
GC_PAUSE = "rankwatch_gc_pause_seconds"
DISPATCHED = re.compile(
    r'^apiserver_flowcontrol_dispatched_requests_total\{flow_schema="' + FLOW_SCHEMA + r'",[^}]*\} (\S+)$', re.M
)


def kubectl(cluster: LocalCluster, *args: str, stdin: str | None = None) -> str:
    command = [str(binaries.binary_path("kubectl")), "--kubeconfig", str(cluster.kubeconfig), *args]
    result = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise SystemExit(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def operator_identity(cluster: LocalCluster, server: str) -> Path:
    """A kubeconfig for the operator's own user (bound to cluster-admin, outside system:masters so that
    the FlowSchema below, not the built-in ``exempt`` one, matches it) and that FlowSchema."""
    if not (cluster.pki / f"{OPERATOR.stem}.crt").exists():
        pki.issue_client(cluster.pki, OPERATOR)
    path = kubeconfig.write(
        cluster.root / "kubeconfigs" / f"{OPERATOR.stem}.kubeconfig", server, cluster.pki, OPERATOR.stem
    )
    subject = {"kind": "User", "name": OPERATOR.user}
    manifests = [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": FLOW_SCHEMA},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{**subject, "apiGroup": "rbac.authorization.k8s.io"}],
        },
        {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "FlowSchema",
            "metadata": {"name": FLOW_SCHEMA},
            "spec": {
                "matchingPrecedence": 100,
                "priorityLevelConfiguration": {"name": "exempt"},
                "rules": [
                    {
                        "subjects": [{"kind": "User", "user": {"name": OPERATOR.user}}],
                        "resourceRules": [
                            {
                                "verbs": ["*"],
                                "apiGroups": ["*"],
                                "resources": ["*"],
                                "namespaces": ["*"],
                                "clusterScope": True,
                            }
                        ],
                        "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
                    }
                ],
            },
        },
    ]
    kubectl(
        cluster,
        "apply",
        "--server-side",
        "-f",
        "-",
        stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests}),
    )
    return path


def operator_requests(client: kubernetes.client.ApiClient) -> float:
    """Requests the API server has dispatched for the operator's user so far (all verbs, watches included)."""
    response = client.call_api("/metrics", "GET", auth_settings=["BearerToken"], _preload_content=False)
    return sum(float(value) for value in DISPATCHED.findall(response.data.decode()))


def operator_usage(client: kubernetes.client.ApiClient, pid: int) -> tuple[float, float]:
    """(API requests so far, CPU seconds of the operator and its child processes so far)."""
    return operator_requests(client), tree_cpu_seconds(pid)[1]


def pod_resources(gpus_per_pod: int, ranks_per_pod: int) -> dict[str, Any]:
    """The pod's share of its node: its GPUs when they hold its ranks; else the same share of the node's
    CPUs less :data:`INJECTED_CPU_MILLIS` (the CRD refuses a pod asking for fewer GPUs than it has ranks,
    and the nominal ranks here need none), so that as many pods fit on a node either way."""
    if gpus_per_pod >= ranks_per_pod:
        return {"nvidia.com/gpu": gpus_per_pod}
    return {"cpu": f"{CPUS_PER_NODE * 1000 * gpus_per_pod // GPUS_PER_NODE - INJECTED_CPU_MILLIS}m"}


def install_crd(cluster: LocalCluster, patience_s: float = 60.0) -> None:
    """Apply the TrainingJob CRD and wait until it is Established. Polled here, not with ``kubectl
    wait``: until the API server has looked at a new CRD it has no ``status.conditions``, and ``kubectl
    wait`` then fails at once instead of waiting (seen on a fresh cluster, even after a read had shown
    the conditions)."""
    kubectl(cluster, "apply", "--server-side", "--force-conflicts", "-f", str(CRD_PATH))
    deadline = time.monotonic() + patience_s

    def established() -> bool:
        crd = json.loads(kubectl(cluster, "get", f"crd/{CRD_NAME}", "-o", "json"))
        conditions = crd.get("status", {}).get("conditions") or []
        return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)

    while not established():
        if time.monotonic() > deadline:
            raise SystemExit(f"crd/{CRD_NAME} is not Established after {patience_s:.0f} s")
        time.sleep(1)


def training_job(
    name: str, replicas: int, gpus_per_pod: int, ranks_per_pod: int, sidecars: bool = False
) -> dict[str, Any]:
    """The job's manifest; with ``sidecars`` its parallelism is the layout of the summaries played for it
    (TP 8 x DP x PP, ``operator_scale.layout_of``) and its window the played one, so that the monitor's
    detector reads them as they are meant."""
    parallelism = {"tensor": ranks_per_pod}
    tracing = {}
    if sidecars:
        parallelism["pipeline"] = layout_of(replicas * ranks_per_pod)
        tracing["windowSeconds"] = WINDOW_S  # the CRD's default, said outright
    return {
        "apiVersion": f"{rankwatch_api.GROUP}/{rankwatch_api.VERSION}",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "nprocPerNode": ranks_per_pod,
            "parallelism": parallelism,
            **({"tracing": tracing} if tracing else {}),
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "example.invalid/density:none",  # kwok runs nothing
                            "command": ["torchrun", "train.py"],
                            "resources": {"limits": pod_resources(gpus_per_pod, ranks_per_pod)},
                        }
                    ]
                }
            },
        },
    }


def statuses(custom: kubernetes.client.CustomObjectsApi, namespace: str) -> dict[str, dict[str, Any]]:
    listed = custom.list_namespaced_custom_object(
        rankwatch_api.GROUP, rankwatch_api.VERSION, namespace, rankwatch_api.PLURAL
    )
    return {item["metadata"]["name"]: item.get("status") or {} for item in listed["items"]}


def pod_count(core: kubernetes.client.CoreV1Api, namespace: str) -> int:
    """Pods in ``namespace`` from a one-item page (the API server counts the rest), not a full list."""
    page = core.list_namespaced_pod(namespace, limit=1)
    return len(page.items) + (page.metadata.remaining_item_count or 0)


def wait_gone(core: kubernetes.client.CoreV1Api, namespace: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            core.read_namespace(namespace)
        except ApiException as error:
            if error.status == 404:
                return
            raise
        time.sleep(2)
    raise SystemExit(f"namespace {namespace} still there after {timeout:.0f} s")


def remove_earlier_steps(core: kubernetes.client.CoreV1Api, timeout: float) -> None:
    """Delete the namespaces of earlier steps (or of an interrupted run) and wait until they are gone."""
    earlier = [item.metadata.name for item in core.list_namespace().items if item.metadata.name.startswith(PREFIX)]
    for namespace in earlier:
        with contextlib.suppress(ApiException):
            core.delete_namespace(namespace)
    for namespace in earlier:
        wait_gone(core, namespace, timeout)


def job_tokens(core: kubernetes.client.CoreV1Api, namespace: str, jobs: list[str]) -> dict[str, str]:
    """Each job's sidecar token, from the Secret the operator wrote for it (read as its collector reads it)."""
    tokens = {}
    for job in jobs:
        token = secret_token(core.read_namespaced_secret(rankwatch_api.token_secret_name(job), namespace))
        if not token:
            raise SystemExit(f"Secret {namespace}/{rankwatch_api.token_secret_name(job)} holds no token")
        tokens[job] = token
    return tokens


def pod_nodes(
    core: kubernetes.client.CoreV1Api, namespace: str, jobs: list[str], replicas: int
) -> dict[str, list[str]]:
    """The node each worker pod (``<job>-worker-<i>``) is bound to, per job in replica order."""
    bound = {pod.metadata.name: pod.spec.node_name for pod in core.list_namespaced_pod(namespace).items}
    nodes: dict[str, list[str]] = {}
    for job in jobs:
        names = [rankwatch_api.worker_pod_name(job, index) for index in range(replicas)]
        unbound = [name for name in names if not bound.get(name)]
        if unbound:
            raise SystemExit(f"{len(unbound)} worker pods of {job} are not bound to a node: {unbound[:3]}")
        nodes[job] = [bound[name] for name in names]
    return nodes


def collector_metrics(port: int) -> dict[str, float]:
    """The operator's own metrics from its collector's /metrics (served without a token): each sample's
    value summed over its labels, the detector histogram's buckets by bound (``..._bucket:<le>``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name in (f"{DETECTOR}_bucket", f"{LOOP_LAG}_bucket"):
                name = f"{name}:{sample.labels['le']}"
            elif name.startswith(GC_PAUSE):  # by generation (and bound): rankwatch_gc_pause_seconds_count:2
                name = ":".join(
                    [name, sample.labels["generation"], *([sample.labels["le"]] if "le" in sample.labels else [])]
                )
            elif name == "rankwatch_collector_messages_total":
                name = f"{name}:{sample.labels['result']}"
            totals[name] = totals.get(name, 0.0) + sample.value
    return totals


def reset_peak_rss(pid: int) -> None:
    """Start each process's peak resident memory (VmHWM) over from now (``clear_refs`` 5), so the peak
    read later is the phase's, not the pods' creation's."""
    for member in process_tree(pid):
        with contextlib.suppress(OSError), open(f"/proc/{member}/clear_refs", "w") as refs:
            refs.write("5")


def loop_schedstat(pid: int) -> tuple[float, float]:
    """(seconds run, seconds waited for a CPU while runnable) of the operator's main thread, its event loop
    (``/proc/<pid>/task/<pid>/schedstat``): on a shared machine, whether its pauses are its own or a queue."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as stat:
        ran, waited = stat.read().split()[:2]
    return int(ran) / 1e9, int(waited) / 1e9


def play_sidecars(
    args: argparse.Namespace,
    admin: kubernetes.client.ApiClient,
    namespace: str,
    jobs: list[str],
    replicas: int,
    port: int,
    pid: int,
) -> dict[str, Any]:
    """Every worker pod's sidecar against the operator's own collector for ``--sidecar-windows`` windows
    (operator_scale's senders, the jobs' real tokens, pods and nodes): what the operator used meanwhile."""
    core = kubernetes.client.CoreV1Api(admin)
    world = replicas * RANKS_PER_POD
    tokens = job_tokens(core, namespace, jobs)
    nodes = pod_nodes(core, namespace, jobs, replicas)
    generator = random.Random(0)
    built = time.monotonic()
    windows = [
        job_bodies(namespace, jobs, world, number + 1, generator, nodes) for number in range(args.sidecar_windows)
    ]
    pods = len(windows[0])
    print(f"  sidecars: {pods} pods x {RANKS_PER_POD} ranks, {args.sidecar_windows} windows of {WINDOW_S} s built "
          f"in {time.monotonic() - built:.0f} s (load average {os.getloadavg()[0]:.2f})", flush=True)  # fmt: skip
    reset_peak_rss(pid)
    before = collector_metrics(port)
    requests_before, requests_from = operator_requests(admin), time.monotonic()
    load_before = os.getloadavg()[0]
    sched_before, sched_from = loop_schedstat(pid), time.monotonic()
    reports, start, cpu_marks, rss_marks = send(
        port, namespace, tokens, windows, WINDOW_S, pid, args.senders, args.connections
    )
    cpu_marks.append(tree_cpu_seconds(pid))  # after the last answer: all the work of every summary
    sched_after, phase_s = loop_schedstat(pid), time.monotonic() - sched_from
    loop_ran_s, loop_queued_s = sched_after[0] - sched_before[0], sched_after[1] - sched_before[1]
    load_end = os.getloadavg()[0]
    requests = (operator_requests(admin) - requests_before) / (time.monotonic() - requests_from)
    rss, peak = tree_rss_mib(pid)
    time.sleep(WINDOW_S)  # the monitor's pass over the last window
    after = collector_metrics(port)
    figures = load_figures(reports, start, cpu_marks, pods, args.sidecar_windows, WINDOW_S)
    print(f"  sidecars: {describe_senders(figures, args.senders, WINDOW_S)}", flush=True)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    runs, spent = grew(f"{DETECTOR}_count"), grew(f"{DETECTOR}_sum")
    bounds = sorted(
        (float(name.rsplit(":", 1)[1]), grew(name)) for name in after if name.startswith(f"{DETECTOR}_bucket:")
    )
    refused = {
        name.rsplit(":", 1)[1]: int(grew(name))
        for name in after
        if name.startswith("rankwatch_collector_messages_total:") and not name.endswith(":accepted") and grew(name)
    }

    def bound(prefix: str, share: float) -> float:
        """The smallest bucket bound under which ``share`` of what grew in histogram ``prefix`` lies, in ms."""
        grown = sorted((float(name.rsplit(":", 1)[1]), grew(name)) for name in after if name.startswith(prefix))
        total = grown[-1][1] if grown else 0.0
        return 1e3 * next((le for le, count in grown if total and count >= share * total), float("nan"))

    pauses = {"loop_lag_p99_ms_bound": bound(f"{LOOP_LAG}_bucket:", 0.99),
              "loop_lag_max_ms_bound": bound(f"{LOOP_LAG}_bucket:", 1.0)}  # fmt: skip
    for generation in range(3):
        pauses[f"gc{generation}_count"] = grew(f"{GC_PAUSE}_count:{generation}")
        pauses[f"gc{generation}_ms"] = 1e3 * grew(f"{GC_PAUSE}_sum:{generation}")
        pauses[f"gc{generation}_max_ms_bound"] = bound(f"{GC_PAUSE}_bucket:{generation}:", 1.0)
    print("  pauses (the operator's /metrics): event loop lag p99 / max under "
          f"{pauses['loop_lag_p99_ms_bound']:g} / {pauses['loop_lag_max_ms_bound']:g} ms; collections: "
          + ", ".join(f"gen {g} {pauses[f'gc{g}_count']:.0f} x, {pauses[f'gc{g}_ms']:.0f} ms, longest under "
                      f"{pauses[f'gc{g}_max_ms_bound']:g} ms" for g in range(3)), flush=True)  # fmt: skip
    print(f"  the event loop's thread over the phase's {phase_s:.0f} s: ran {loop_ran_s:.1f} s, waited "
          f"{loop_queued_s:.1f} s for a CPU while runnable ({loop_queued_s / phase_s:.0%} of the phase); load "
          f"average {load_before:.2f} as the sidecars started, {load_end:.2f} as the last was answered",
          flush=True)  # fmt: skip
    return {
        **{key: value for key, value in figures.items() if key != "statuses"},
        **pauses,
        "statuses": {str(status): count for status, count in figures["statuses"].items()},
        "sidecar_pods": pods,
        "sidecar_windows": args.sidecar_windows,
        "sidecar_load": load_before,
        "sidecar_load_end": load_end,
        "sidecar_phase_s": phase_s,
        "loop_ran_s": loop_ran_s,
        "loop_queued_s": loop_queued_s,
        "loop_queued_share": loop_queued_s / phase_s,
        "sidecar_rss_mib": rss,
        "sidecar_rss_max_mib": max([*rss_marks, rss]),
        "sidecar_rss_by_window_mib": [round(mib) for mib in rss_marks],  # does it level off once 12 are kept?
        "sidecar_peak_rss_mib": peak,
        "sidecar_requests_per_s": requests,
        "accepted_by_collector": grew("rankwatch_collector_messages_total:accepted"),
        "refused_by_collector": refused,
        "detector_runs": runs,
        "detect_job_ms": 1e3 * spent / runs if runs else float("nan"),
        "detect_window_ms": 1e3 * spent / (runs / len(jobs)) if runs else float("nan"),
        "detect_job_ms_bound": 1e3 * next((le for le, count in bounds if count >= runs), float("inf")),
        "suspicions": grew("rankwatch_detector_suspicions_total"),
        "diagnoses": grew("rankwatch_diagnoses_total"),
    }


def run_step(
    cluster: LocalCluster, args: argparse.Namespace, nodes: int, jobs: int, operator_config: Path
) -> dict[str, Any]:
    step_started = time.monotonic()
    cluster.up(nodes, log=lambda message: print(f"  [cluster] {message}", flush=True), timeout=600)
    nodes_ready = time.monotonic() - step_started
    admin = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
    core, custom = kubernetes.client.CoreV1Api(admin), kubernetes.client.CustomObjectsApi(admin)
    namespace = f"{PREFIX}{nodes}-{jobs}"
    remove_earlier_steps(core, args.timeout)  # their pods hold the GPUs this step's pods need
    core.create_namespace({"metadata": {"name": namespace}})
    pods = nodes * args.pods_per_node
    if pods % jobs:
        raise SystemExit(f"{pods} pods do not split evenly over {jobs} jobs")
    replicas, gpus_per_pod = pods // jobs, GPUS_PER_NODE // args.pods_per_node

    sidecars = args.sidecar_windows > 0
    port = free_port()
    operator = start_operator(operator_config, namespace, cluster.logs / f"operator-{namespace}.log", port)
    try:
        time.sleep(args.warmup)  # its watches listed and established; their cost is in the idle figures too
        if operator.poll() is not None:
            raise SystemExit(f"the operator exited with {operator.returncode}; see {cluster.logs}")
        created: dict[str, float] = {}
        requests_before, cpu_before = operator_usage(admin, operator.pid)
        started = time.monotonic()
        for index in range(jobs):
            name = f"job-{index:02d}"
            custom.create_namespaced_custom_object(
                rankwatch_api.GROUP,
                rankwatch_api.VERSION,
                namespace,
                rankwatch_api.PLURAL,
                training_job(name, replicas, gpus_per_pod, args.ranks_per_pod, sidecars),
            )
            created[name] = time.monotonic()
        running: dict[str, float] = {}
        ready: dict[str, float] = {}  # every worker Ready (status.workers N/N): kwok marks Ready after Running
        all_created = all_running = None  # seconds until the operator had made every pod, every job Running
        peak_rss = 0.0
        while len(ready) < jobs:
            if time.monotonic() - started > args.timeout:
                late = sorted(set(created) - set(running))
                why = {name: status.get("reason") for name, status in statuses(custom, namespace).items()}
                raise SystemExit(
                    f"{len(late)} jobs not Running after {args.timeout:.0f} s: "
                    + ", ".join(f"{name} ({why.get(name)})" for name in late[:5])
                    + f"; `kubectl get events -n {namespace}` says why"
                )
            if all_running is not None and time.monotonic() - started > all_running + args.ready_wait:
                break  # kwok left some pods not Ready (a node it let go NotReady meanwhile): idle from here
            if operator.poll() is not None:
                raise SystemExit(f"the operator exited with {operator.returncode}; see {cluster.logs}")
            now = time.monotonic()
            for name, status in statuses(custom, namespace).items():
                if status.get("phase") == "Running" and name not in running:
                    running[name] = now - created[name]
                if status.get("workers") == f"{replicas}/{replicas}" and name not in ready:
                    ready[name] = now - created[name]
            if all_running is None and len(running) == jobs:
                all_running = now - started
            if all_created is None and pod_count(core, namespace) >= pods:
                all_created = now - started
            peak_rss = max(peak_rss, tree_rss_mib(operator.pid)[1])
            time.sleep(1)
        ramp = time.monotonic() - started
        requests_after, cpu_after = operator_usage(admin, operator.pid)
        requests_ramp, cpu_ramp = requests_after - requests_before, cpu_after - cpu_before
        time.sleep(args.settle)
        requests_end, cpu_end = operator_usage(admin, operator.pid)
        requests_idle, cpu_idle = requests_end - requests_after, cpu_end - cpu_after
        rss, peak_rss = tree_rss_mib(operator.pid)
        pods_running = sum(1 for pod in core.list_namespaced_pod(namespace).items if pod.status.phase == "Running")
        played = {}
        if sidecars:
            played = play_sidecars(args, admin, namespace, sorted(created), replicas, port, operator.pid)
        if operator.poll() is not None:
            raise SystemExit(f"the operator exited with {operator.returncode} under the sidecars; see {cluster.logs}")
    finally:
        operator.terminate()
        try:
            operator.wait(30)
        except subprocess.TimeoutExpired:
            operator.kill()
            operator.wait()
    times = sorted(running.values())
    return {
        "nodes": nodes,
        "jobs": jobs,
        "pods": pods,
        "pods_running": pods_running,
        "ranks": pods * args.ranks_per_pod,
        "nodes_ready_s": nodes_ready,
        "pods_created_s": all_created,
        "running_median_s": statistics.median(times),
        "running_all_s": all_running,
        "running_slowest_s": times[-1],
        "ready_all_s": ramp if len(ready) == jobs else None,
        "jobs_all_ready": len(ready),
        "cpu_ramp": cpu_ramp / ramp,
        "cpu_idle": cpu_idle / args.settle,
        "rss_mib": rss,
        "peak_rss_mib": peak_rss,
        "requests_ramp_per_s": requests_ramp / ramp,
        "requests_ramp": requests_ramp,
        "requests_idle_per_s": requests_idle / args.settle,
        **played,
    }


def print_sidecar_figures(rows: list[dict[str, Any]]) -> None:
    """The sidecar phase of each step: the operator keeping up with its jobs' summaries, or not."""
    columns = [  # header, figure, format, scale
        ("ranks", "ranks", ">6.0f", 1),
        ("pods", "sidecar_pods", ">5.0f", 1),
        ("load", "sidecar_load", ">5.1f", 1),
        *LOAD_COLUMNS,
        ("RSS MiB", "sidecar_rss_mib", ">7.0f", 1),
        ("peak", "sidecar_peak_rss_mib", ">6.0f", 1),
        ("req/s", "sidecar_requests_per_s", ">6.2f", 1),
        ("det ms", "detect_window_ms", ">7.1f", 1),
        ("1 job", "detect_job_ms", ">6.2f", 1),
        ("susp", "suspicions", ">5.0f", 1),
        ("snd%", "sender_cpu_share", ">4.0f", 100),
        ("wait%", "loop_queued_share", ">5.0f", 100),
    ]
    print("\nsidecars played against the operator's collector:")
    print_table(rows, columns)
    print(
        "load: the 1-minute load average as the sidecars start; CPU%: the operator with its child processes "
        "as a share of one core, mean over the windows / second half / worst window; loop%: its main "
        "process alone; RSS, peak: the operator's processes together at the end and at their peak during "
        "the phase (peaks reset as it starts); req/s: its API requests per second meanwhile; det ms: the "
        "detector's time per window over all jobs, 1 job: per job (rankwatch_detector_duration_seconds); "
        "susp: suspicions raised (rankwatch_detector_suspicions_total); snd%: the senders' own CPU; wait%: the share "
        "of the phase the operator's event loop thread was runnable but waiting for a CPU (its schedstat)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="100:5,1000:50", help="NODES:JOBS,... (the node pool is resized to NODES)")
    parser.add_argument("--pods-per-node", type=int, default=8, help="worker pods per node (GPUs split evenly)")
    parser.add_argument("--ranks-per-pod", type=int, default=8, help="nprocPerNode of every job")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds for the operator to start watching")
    parser.add_argument(
        "--ready-wait", type=float, default=120.0, help="seconds after all Running to wait for every worker Ready"
    )
    parser.add_argument("--settle", type=float, default=60.0, help="seconds of idle measurement once all run")
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--down", action="store_true", help="remove the cluster at the end")
    parser.add_argument(
        "--sidecar-windows",
        type=int,
        default=0,
        help=f"once idle, play every worker pod's sidecar against the operator's collector for N windows of "
        f"{WINDOW_S} s (0: none)",
    )
    parser.add_argument("--senders", type=int, default=2, help="processes playing the sidecars")
    parser.add_argument("--connections", type=int, default=512, help="keep-alive connections over all senders")
    args = parser.parse_args()
    if args.sidecar_windows and args.ranks_per_pod != RANKS_PER_POD:
        raise SystemExit(f"--sidecar-windows plays pods of {RANKS_PER_POD} ranks (TP {TP}): --ranks-per-pod 8")
    if GPUS_PER_NODE % args.pods_per_node:
        raise SystemExit(f"--pods-per-node must divide {GPUS_PER_NODE}")
    steps = [tuple(int(part) for part in step.split(":")) for step in args.steps.split(",")]

    cluster = LocalCluster()
    print(f"cluster in {cluster.root}; load average {os.getloadavg()[0]:.2f} at start", flush=True)
    try:
        began = time.monotonic()
        state = cluster.up(steps[0][0], log=lambda message: print(f"  [cluster] {message}", flush=True), timeout=600)
        print(f"cluster up with {steps[0][0]} nodes Ready: {time.monotonic() - began:.1f} s", flush=True)
        install_crd(cluster)
        operator_config = operator_identity(cluster, cluster.server(state))
        header = (
            f"{'nodes':>6} {'jobs':>5} {'pods':>6} {'ranks':>7} {'nodes up':>9} {'created':>8} {'median':>8} "
            f"{'all':>8} {'all ready':>10} {'cpu ramp':>9} {'cpu idle':>9} {'rss MiB':>8} {'peak MiB':>9} "
            f"{'req/s ramp':>11} {'req/s idle':>11}"
        )
        rows = []
        for nodes, jobs in steps:
            print(f"step: {nodes} nodes, {jobs} jobs (load average {os.getloadavg()[0]:.2f})", flush=True)
            row = run_step(cluster, args, nodes, jobs, operator_config)
            print(json.dumps(row), flush=True)
            rows.append(row)
        print(header)
        for row in rows:
            print(
                f"{row['nodes']:>6} {row['jobs']:>5} {row['pods']:>6} {row['ranks']:>7} "
                f"{row['nodes_ready_s']:>8.1f}s {row['pods_created_s'] or float('nan'):>7.1f}s "
                f"{row['running_median_s']:>7.1f}s {row['running_all_s']:>7.1f}s "
                f"{row['ready_all_s'] or float('nan'):>9.1f}s "
                f"{row['cpu_ramp']:>8.0%} "
                f"{row['cpu_idle']:>8.0%} {row['rss_mib']:>8.0f} {row['peak_rss_mib']:>9.0f} "
                f"{row['requests_ramp_per_s']:>11.1f} {row['requests_idle_per_s']:>11.2f}"
            )
        if args.sidecar_windows:
            print_sidecar_figures(rows)
        print(f"load average {os.getloadavg()[0]:.2f} at the end", flush=True)
    finally:
        if args.down:
            cluster.down(lambda message: print(f"  [cluster] {message}", flush=True))


if __name__ == "__main__":
    main()
