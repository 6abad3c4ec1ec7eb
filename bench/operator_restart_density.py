"""A restarted operator at density: how long until it acts again with thousands of pods present.

A failover or a crash-looping operator meets every pod of the cluster at once: kopf lists them, fills
the operator's pod index and only then runs the handlers. On the local cluster with kwok nodes (as
``cluster_density.py``: worker pods exist only in the API) this bench makes ``JOBS`` TrainingJobs
over ``NODES`` nodes, waits until every job is Running, kills the operator (SIGKILL: no clean-up),
starts a new one, and at once deletes one worker pod of each of ``--probes`` jobs. Measured: time from
the new operator's start to every deleted pod made again (what a job waits for after a failover), its
CPU, API requests and peak memory over that time.

    RANKWATCH_CLUSTER_DIR=~/.rankwatch/density python bench/operator_restart_density.py [--nodes 1000] [--jobs 50]
        [--probes 5] [--timeout 1200] [--down]
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import kubernetes
from cluster_density import (
    PREFIX,
    install_crd,
    operator_identity,
    operator_requests,
    operator_usage,
    remove_earlier_steps,
    statuses,
    training_job,
)
from operator_scale import tree_rss_mib

from rankwatch.cluster.local import LocalCluster
from rankwatch.cluster.nodes import GPUS_PER_NODE
from rankwatch.cluster.operator_process import start_operator
from rankwatch.cluster.ports import free_port
from rankwatch.operator import api as rankwatch_api

PODS_PER_NODE = 8
RANKS_PER_POD = 8


def wait_all_running(custom, namespace: str, jobs: int, operator, timeout: float) -> float:
    started = time.monotonic()
    while True:
        running = sum(1 for status in statuses(custom, namespace).values() if status.get("phase") == "Running")
        if running == jobs:
            return time.monotonic() - started
        if operator.poll() is not None:
            raise SystemExit(f"the operator exited with {operator.returncode}")
        if time.monotonic() - started > timeout:
            raise SystemExit(f"{jobs - running} jobs not Running after {timeout:.0f} s")
        time.sleep(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--probes", type=int, default=5, help="jobs that lose one worker pod at the restart")
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--down", action="store_true", help="remove the cluster at the end")
    args = parser.parse_args()
    pods = args.nodes * PODS_PER_NODE
    if pods % args.jobs:
        raise SystemExit(f"{pods} pods do not split evenly over {args.jobs} jobs")
    replicas = pods // args.jobs

    cluster = LocalCluster()
    print(f"cluster in {cluster.root}; load average {os.getloadavg()[0]:.2f} at start", flush=True)
    try:
        state = cluster.up(args.nodes, log=lambda message: print(f"  [cluster] {message}", flush=True), timeout=600)
        install_crd(cluster)
        operator_config = operator_identity(cluster, cluster.server(state))
        admin = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
        core, custom = kubernetes.client.CoreV1Api(admin), kubernetes.client.CustomObjectsApi(admin)
        namespace = f"{PREFIX}restart-{args.nodes}-{args.jobs}"
        remove_earlier_steps(core, args.timeout)
        core.create_namespace({"metadata": {"name": namespace}})
        log = cluster.logs / f"operator-{namespace}.log"
        operator = start_operator(operator_config, namespace, log, free_port())
        try:
            time.sleep(10)
            for index in range(args.jobs):
                job = training_job(f"job-{index:02d}", replicas, GPUS_PER_NODE // PODS_PER_NODE, RANKS_PER_POD)
                custom.create_namespaced_custom_object(
                    rankwatch_api.GROUP, rankwatch_api.VERSION, namespace, rankwatch_api.PLURAL, job
                )
            took = wait_all_running(custom, namespace, args.jobs, operator, args.timeout)
            print(f"{args.jobs} jobs, {pods} pods Running {took:.0f} s after creation", flush=True)
            time.sleep(30)  # the status syncs of late readiness settle
            first_rss = tree_rss_mib(operator.pid)[1]
            operator.send_signal(signal.SIGKILL)
            operator.wait(30)

            load = os.getloadavg()[0]
            requests_before, cpu_before = operator_requests(admin), 0.0  # a new process: its CPU from 0
            started = time.monotonic()
            operator = start_operator(operator_config, namespace, log, free_port())
            probes = [f"job-{index:02d}-worker-0" for index in range(args.probes)]
            uids = {name: core.read_namespaced_pod(name, namespace).metadata.uid for name in probes}
            for name in probes:
                core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
            remade: dict[str, float] = {}
            peak = 0.0
            while len(remade) < len(probes):
                now = time.monotonic() - started
                if now > args.timeout:
                    raise SystemExit(
                        f"pods not made again after {args.timeout:.0f} s: {sorted(set(probes) - set(remade))}"
                    )
                if operator.poll() is not None:
                    raise SystemExit(f"the new operator exited with {operator.returncode}; see {log}")
                for name in set(probes) - set(remade):
                    try:
                        pod = core.read_namespaced_pod(name, namespace)
                    except kubernetes.client.exceptions.ApiException as error:
                        if error.status != 404:
                            raise
                        continue
                    if pod.metadata.uid != uids[name]:
                        remade[name] = now
                peak = max(peak, tree_rss_mib(operator.pid)[1])
                time.sleep(0.5)
            requests_after, cpu_after = operator_usage(admin, operator.pid)
            elapsed = time.monotonic() - started
            print(
                f"restart with {pods} pods present (load average {load:.1f}): deleted pods made again after "
                f"{min(remade.values()):.1f}-{max(remade.values()):.1f} s; CPU {cpu_after - cpu_before:.1f} s "
                f"({(cpu_after - cpu_before) / elapsed:.0%} of a core), {requests_after - requests_before:.0f} "
                f"requests; peak RSS {peak:.0f} MiB (the first operator: {first_rss:.0f} MiB); load average "
                f"{os.getloadavg()[0]:.1f} at the end",
                flush=True,
            )
        finally:
            operator.terminate()
            operator.wait(30)
    finally:
        if args.down:
            cluster.down(lambda message: print(f"  [cluster] {message}", flush=True))


if __name__ == "__main__":
    main()
