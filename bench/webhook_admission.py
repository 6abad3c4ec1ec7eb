"""What the injection webhook costs a pod's creation: the API server's answer to a pod create (a
server-side dry run, so nothing piles up) in a namespace not opted in (the webhook is not called), in
an opted-in one (called, injects), and opted in with the operator stopped (fails open).

    .venv/bin/python bench/webhook_admission.py [--pods 200] [--cluster-dir DIR]

The local cluster (``DIR``, default ~/.rankwatch/bench-cluster) is brought up if needed; the operator
runs as a child process serving the webhook on loopback, registered with the chart's configuration.
Figures go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import base64
import os
import signal
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import kubernetes
import yaml

from rankwatch.cluster import pki
from rankwatch.cluster.binaries import ensure_tool
from rankwatch.cluster.local import LocalCluster
from rankwatch.cluster.operator_process import start_operator
from rankwatch.cluster.ports import free_port

REPO = Path(__file__).parents[1]


def opted_in_pod(namespace: str) -> dict[str, Any]:
    """A pod of an Indexed Job that opted in (the Job need not exist for a dry run)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "bench-",
            "namespace": namespace,
            "annotations": {"rankwatch.io/inject": "true", "batch.kubernetes.io/job-completion-index": "0"},
            "ownerReferences": [
                {"apiVersion": "batch/v1", "kind": "Job", "name": "bench", "uid": str(uuid.uuid4()), "controller": True}
            ],
        },
        "spec": {"containers": [{"name": "trainer", "image": "trainer:1", "command": ["torchrun", "train.py"]}]},
    }


def latencies(core: kubernetes.client.CoreV1Api, namespace: str, count: int) -> tuple[list[float], int]:
    """Seconds per create, and how many came back injected."""
    times, injected = [], 0
    for _ in range(count):
        started = time.perf_counter()
        pod = core.create_namespaced_pod(namespace, opted_in_pod(namespace), dry_run="All")
        times.append(time.perf_counter() - started)
        injected += any(c.name == "rankwatch-sidecar" for c in pod.spec.init_containers or [])
    return times, injected


def report(label: str, times: list[float], injected: int) -> None:
    ordered = sorted(times)
    p95 = ordered[int(0.95 * (len(ordered) - 1))]
    print(
        f"{label:<44} p50 {statistics.median(times) * 1e3:6.1f} ms   p95 {p95 * 1e3:6.1f} ms   "
        f"max {ordered[-1] * 1e3:6.1f} ms   injected {injected}/{len(times)}",
        flush=True,
    )


def handler_cpu(count: int = 500) -> float:
    """CPU seconds of the admission handler and its JSON patch per pod, in this process."""
    import asyncio
    import copy

    import kopf

    from rankwatch.operator.config import WorkerPodSettings
    from rankwatch.operator.kinds import webhook

    pod = opted_in_pod("bench")
    memo = kopf.Memo(config=type("Config", (), {"pods": WorkerPodSettings()})(), kube=None)

    async def admit() -> None:
        body = kopf.Body(copy.deepcopy(pod))
        patch = kopf.Patch(body=body)
        await webhook.inject_pod(body=body, patch=patch, dryrun=True, memo=memo)
        assert patch.as_json_patch()

    async def run() -> float:
        for _ in range(50):
            await admit()
        started = time.process_time()
        for _ in range(count):
            await admit()
        return (time.process_time() - started) / count

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pods", type=int, default=200, help="creates per case")
    parser.add_argument("--cluster-dir", default=os.path.expanduser("~/.rankwatch/bench-cluster"))
    args = parser.parse_args()
    print(f"{'the handler and its JSON patch (CPU, in process)':<44} {handler_cpu() * 1e3:6.2f} ms per pod", flush=True)
    cluster = LocalCluster(Path(args.cluster_dir))
    cluster.up(log=lambda _: None)
    kubeconfig = str(cluster.kubeconfig)
    api = kubernetes.config.new_client_from_config(config_file=kubeconfig)
    core = kubernetes.client.CoreV1Api(api)
    suffix = uuid.uuid4().hex[:6]
    opted, plain = f"bench-inject-{suffix}", f"bench-plain-{suffix}"
    core.create_namespace({"metadata": {"name": opted, "labels": {"rankwatch.io/inject": "enabled"}}})
    core.create_namespace({"metadata": {"name": plain}})
    with tempfile.TemporaryDirectory() as work:
        certs, port = Path(work) / "tls", free_port()
        pki.issue_serving(certs, ["127.0.0.1"])
        ca = base64.b64encode((certs / "ca.crt").read_bytes()).decode()
        rendered = subprocess.run(
            [str(ensure_tool("helm")), "template", f"bench-{suffix}", str(REPO / "helm" / "rankwatch"),
             "--set", "webhook.enabled=true", "--set", f"webhook.url=https://127.0.0.1:{port}",
             "--set", f"webhook.caBundle={ca}", "--show-only", "templates/webhook.yaml"],
            env={"HOME": work, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        [configuration] = [doc for doc in yaml.safe_load_all(rendered) if doc]
        hooks = kubernetes.client.AdmissionregistrationV1Api(api)
        hooks.create_mutating_webhook_configuration(configuration)
        settings = {"RANKWATCH_WEBHOOK_LISTEN": f"127.0.0.1:{port}", "RANKWATCH_WEBHOOK_CERT_DIR": str(certs)}
        operator = start_operator(kubeconfig, opted, Path(work) / "operator.log", free_port(), settings)
        try:
            while latencies(core, opted, 1)[1] == 0:  # until the operator's webhook answers
                time.sleep(0.5)
            report("namespace not opted in (webhook not called)", *latencies(core, plain, args.pods))
            report("opted in, operator up (injected)", *latencies(core, opted, args.pods))
            operator.send_signal(signal.SIGTERM)
            operator.wait(300)
            report("opted in, operator stopped (fails open)", *latencies(core, opted, args.pods))
        finally:
            if operator.poll() is None:
                operator.kill()
            hooks.delete_mutating_webhook_configuration(configuration["metadata"]["name"])
            core.delete_namespace(opted)
            core.delete_namespace(plain)
    print(f"load average while measuring: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
