"""The `rankwatch` command: one entry point whose subcommands call into the packages."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rankwatch.standins.simulate import HostCost


def _cluster(args: argparse.Namespace) -> int:
    if args.action == "run-pods":
        from pathlib import Path

        from rankwatch.cluster.pod_runner import run_pods

        if not args.collector_url and not args.collector_service:
            print("rankwatch cluster run-pods: --collector-url or --collector-service is required", file=sys.stderr)
            return 2
        work_dir = Path(args.work_dir or Path.home() / ".rankwatch" / "pods")
        log = lambda m: print(m, flush=True)  # noqa: E731
        return run_pods(args.collector_url, args.namespace, work_dir, log, args.collector_service)
    from rankwatch.cluster.binaries import BuildError
    from rankwatch.cluster.kueue import KueueError
    from rankwatch.cluster.local import LocalCluster
    from rankwatch.cluster.monitoring import LocalMonitoring, MonitoringError
    from rankwatch.cluster.state import ClusterError

    cluster = LocalCluster()
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    try:
        if args.action == "up":
            cluster.up(nodes=args.nodes, log=log, timeout=args.timeout, monitoring=args.monitoring, kueue=args.kueue)
        elif args.action == "scrape":
            if not args.job:
                print(
                    "rankwatch cluster scrape: --job is required (with --target HOST:PORT, or none to stop)",
                    file=sys.stderr,
                )
                return 2
            print(LocalMonitoring(cluster).scrape(args.job, args.target))
        elif args.action == "route-alerts":
            LocalMonitoring(cluster).route_alerts_to(args.webhook or None, args.bearer_token_file)
        elif args.action == "down":
            cluster.down(log=log)
        elif args.action == "status":
            status = cluster.status()
            print(json.dumps(status, indent=2))
            return 0 if status["ready"] else 1
        elif args.action == "kubeconfig":
            print(cluster.kubeconfig)
        elif args.action == "build":
            from rankwatch.cluster.binaries import ensure_all
            from rankwatch.cluster.versions import ADMISSION, COMPONENTS, MONITORING, TOOLS

            which = TOOLS if args.tools else MONITORING if args.monitoring else ADMISSION if args.kueue else COMPONENTS
            for name, path in ensure_all(log, which).items():
                print(f"{name}\t{path}")
    except (ClusterError, BuildError, MonitoringError, KueueError) as error:
        print(f"rankwatch cluster {args.action}: {error}", file=sys.stderr)
        return 1
    return 0


def _operator(args: argparse.Namespace) -> int:
    from rankwatch.operator.config import ConfigError, OperatorConfig

    try:
        config = OperatorConfig.from_env(namespaces=tuple(args.namespace), standalone=args.standalone)
    except ConfigError as error:
        print(f"rankwatch operator: {error}", file=sys.stderr)
        return 2
    from rankwatch.operator.main import run

    return run(config)


def _simulate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rankwatch.standins.native import NativeBuildError
    from rankwatch.standins.simulate import Faults, Simulation, SimulationError, run

    simulation = Simulation(
        world_size=args.world_size,
        tp=args.tp,
        pp=args.pp,
        steps=args.steps,
        microbatches=args.microbatches,
        compute_us=args.compute_us,
        ranks_per_node=args.ranks_per_node,
        gpu_timing=args.gpu_timing,
        device=args.device,
        p2p_sync=args.p2p_sync,
        host_cost=_host_cost(args),
        timeout=args.timeout,
        faults=Faults(
            slow_rank=args.slow_rank,
            slowdown=args.slowdown,
            slow_from_call=args.slow_from_call,
            hang_rank=args.hang_rank,
            hang_at=args.hang_at,
            stuck_rank=args.stuck_rank,
            stuck_at=args.stuck_at,
            slow_link=tuple(args.slow_link) if args.slow_link else None,
            link_latency_us=args.link_latency_us,
            device_stop_rank=args.device_stop_rank,
            device_stop_at_kernel=args.device_stop_at_kernel,
            mismatch_rank=args.mismatch_rank,
            mismatch_at=args.mismatch_at,
            mismatch=args.mismatch,
        ),
    )
    try:
        outcomes = run(simulation, Path(args.out), log=lambda m: print(m, file=sys.stderr))
    except (SimulationError, NativeBuildError) as error:
        print(f"rankwatch simulate: {error}", file=sys.stderr)
        return 1
    killed = sum(o.exit_code is None for o in outcomes)
    ended = f"{killed} stopped after the injected hang" if simulation.faults.hangs else "all finished"
    print(f"{len(outcomes)} ranks, {ended}; rings in {args.out}")
    return 0


def _simulate_pod(args: argparse.Namespace) -> int:
    from rankwatch.standins.native import NativeBuildError
    from rankwatch.standins.simulate import PodRun, SimulationError, run_pod

    try:
        pod = PodRun(
            args.tp,
            args.pp,
            args.steps,
            args.microbatches,
            args.compute_us,
            args.python,
            args.device,
            args.p2p_sync,
            _host_cost(args),
        )
        return run_pod(pod)
    except (SimulationError, NativeBuildError) as error:
        print(f"rankwatch simulate-pod: {error}", file=sys.stderr)
        return 2


def _sidecar(args: argparse.Namespace) -> int:
    from rankwatch.sidecar.config import ConfigError, load
    from rankwatch.sidecar.main import main

    try:
        config = load(args)
    except ConfigError as error:
        print(f"rankwatch sidecar: {error}", file=sys.stderr)
        return 2
    return main(config)


def seen_until(text: str) -> int:
    """``now`` or an ISO 8601 time (UTC unless it says otherwise), as ns since the epoch."""
    import datetime
    import time

    if text == "now":
        return time.time_ns()
    moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return int(moment.timestamp() * 1e9)


def _analyze(args: argparse.Namespace) -> int:
    from rankwatch.analysis.analyze import main

    path = args.path or args.log_path
    if not path:
        print("rankwatch analyze: give a PATH (or --log-path)", file=sys.stderr)
        return 2
    from rankwatch.analysis.completeness import GivenLayout
    from rankwatch.analysis.topology import Layout, LayoutError, load_config

    try:
        given = None
        if args.config_path:
            given = GivenLayout(load_config(args.config_path), args.config_path)
        elif args.tp or args.pp:
            if not args.world_size:
                raise LayoutError("--tp/--pp need --world-size")
            flags = " ".join(f"--{flag} {value}" for flag, value in (("tp", args.tp), ("pp", args.pp)) if value)
            layout = Layout(args.tp or 1, args.pp or 1, args.world_size)
            given = GivenLayout(layout, f"{flags} --world-size {args.world_size}")
        elif args.world_size:  # the ranks expected, no coordinates: TP and PP stay unknown
            if args.world_size < 1:
                raise LayoutError(f"--world-size {args.world_size} must be at least 1")
            given = GivenLayout(None, f"--world-size {args.world_size}", args.world_size)
    except LayoutError as error:
        print(f"rankwatch analyze: {error}", file=sys.stderr)
        return 2

    seen_until_ns = None
    if args.seen_until:
        try:
            seen_until_ns = seen_until(args.seen_until)
        except ValueError as error:
            print(f"rankwatch analyze: --seen-until {args.seen_until}: {error}", file=sys.stderr)
            return 2

    def run(source: str, layout: GivenLayout | None, skipped: tuple[str, ...] = ()) -> int:
        return main(
            source,
            args.test_type,
            args.stall_seconds,
            args.json,
            layout,
            args.ranks_per_node,
            args.chrome_trace,
            args.html,
            max(1, args.jobs),
            skipped,
            seen_until_ns,
        )

    from rankwatch.analysis import archive

    if not archive.is_archive(path):
        return run(path, given)
    try:
        with archive.trace_source(path, args.s3_endpoint) as source:
            print(f"reading the {source.description}", file=sys.stderr)
            recorded = GivenLayout(source.layout, "the archive's manifest") if source.layout else None
            return run(str(source.directory), given or recorded, source.problems)
    except archive.ArchiveError as error:
        print(f"rankwatch analyze: {error}", file=sys.stderr)
        return 2


def _alerts(args: argparse.Namespace) -> int:
    from rankwatch.alerting import commands

    if args.action == "silence":
        from rankwatch.alerting import silence_commands

        return silence_commands.run(args)
    if args.action == "report":
        return commands.report(args.config, args.secrets, args.namespace, args.store, args.receiver, args.print)
    if args.action == "serve":
        return commands.serve(args.config, args.secrets, args.namespace, args.listen)
    return commands.test(args.config, args.secrets, args.namespace, args.receiver, args.level)


def _uncordon(args: argparse.Namespace) -> int:
    from rankwatch.kube import api_client
    from rankwatch.operator.remediation.cordon import uncordon, uncordon_job

    if not args.node and not args.all_from_job:
        print("rankwatch uncordon: give NODE(s) or --all-from-job NAMESPACE/NAME", file=sys.stderr)
        return 2
    api = api_client(args.kubeconfig)
    results = [uncordon(api, node, via="cli") for node in args.node]
    if args.all_from_job:
        namespace, _, name = args.all_from_job.partition("/")
        if not (namespace and name):
            print(f"rankwatch uncordon: --all-from-job {args.all_from_job!r}: expected NAMESPACE/NAME", file=sys.stderr)
            return 2
        job_results = uncordon_job(api, namespace, name, via="cli")
        if not job_results:
            print(f"no node carries rankwatch's mark for TrainingJob {namespace}/{name}")
        results += job_results
    for result in results:
        print(f"{result.node}: {result.message}")
    return 1 if any(result.error for result in results) else 0


def _nodes(args: argparse.Namespace) -> int:
    from rankwatch.kube import api_client
    from rankwatch.operator.remediation import node_marks
    from rankwatch.operator.remediation.marked_nodes import marked_nodes, table

    if args.job and "/" not in args.job:
        print(f"rankwatch nodes: --job {args.job!r}: expected NAMESPACE/NAME", file=sys.stderr)
        return 2
    nodes = marked_nodes(api_client(args.kubeconfig), args.job)
    now = node_marks.now()
    if args.output == "json":
        print(json.dumps([node.to_json(now) for node in nodes], indent=2))
    elif not nodes:
        print("no node carries rankwatch's mark" + (f" for TrainingJob {args.job}" if args.job else ""))
    else:
        print(table(nodes, now))
        print("undo: rankwatch uncordon NODE... (or --all-from-job NAMESPACE/NAME)", file=sys.stderr)
    return 0


def _describe(args: argparse.Namespace) -> int:
    from rankwatch.describe import DescribeError, describe
    from rankwatch.kube import api_client

    try:
        print(describe(api_client(args.kubeconfig), args.namespace, args.reference))
    except DescribeError as error:
        print(f"rankwatch describe: {error}", file=sys.stderr)
        return 2 if "not found" not in str(error) else 1
    return 0


def _add_device_arguments(parser: argparse.ArgumentParser, default: str | None) -> None:
    """The stand-in GPU model and Megatron's batch_p2p_sync, for the Megatron-shaped driver."""
    inherit = " (default: RANKWATCH_STANDIN_DEVICE, else async)" if default is None else f" (default {default})"
    parser.add_argument(
        "--device",
        choices=("sync", "async"),
        default=default,
        help="stand-in GPU: sync runs each kernel and collective inside its call; async runs them on streams "
        "behind the host, as a real GPU does" + inherit,
    )
    parser.add_argument(
        "--p2p-sync", action="store_true", help="synchronise the host after each pipeline exchange (batch_p2p_sync)"
    )
    parser.add_argument(
        "--host-us-per-launch",
        type=int,
        help="CPU microseconds the host spends on each launched op (Python, dispatcher, launch; default 0)",
    )
    parser.add_argument(
        "--host-us-per-step",
        type=int,
        help="CPU microseconds the host spends each step (optimizer bookkeeping, the next batch; default 0)",
    )
    parser.add_argument(
        "--kernel-us", type=int, help="GPU time of one launched kernel a compute chunk stands for (default 500)"
    )


def _host_cost(args: argparse.Namespace) -> HostCost:
    """The driver's host cost from --host-us-per-launch, --host-us-per-step and --kernel-us (None: its default)."""
    from rankwatch.standins.simulate import HostCost

    return HostCost(launch_us=args.host_us_per_launch, step_us=args.host_us_per_step, kernel_us=args.kernel_us)


def _version() -> str:
    """The installed distribution's version (the package's own when run from a source tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rankwatch")
    except PackageNotFoundError:
        from rankwatch import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rankwatch", description=__doc__)
    parser.add_argument("--version", action="version", version=f"rankwatch {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    cluster = commands.add_parser("cluster", help="the built-in local Kubernetes cluster (no containers)")
    cluster.add_argument(
        "action", choices=["up", "down", "status", "kubeconfig", "build", "run-pods", "scrape", "route-alerts"]
    )
    cluster.add_argument("--nodes", type=int, default=4, help="fake GPU nodes (8 GPUs each) for `up`")
    cluster.add_argument("--timeout", type=float, default=180.0, help="seconds `up` waits for readiness")
    cluster.add_argument(
        "--tools", action="store_true", help="`build` the test tools (helm, promtool) instead of the cluster binaries"
    )
    cluster.add_argument(
        "--monitoring",
        action="store_true",
        help="`up`: also Prometheus and Alertmanager (loading the chart's rules); `build`: only those two",
    )
    cluster.add_argument(
        "--kueue",
        action="store_true",
        help="`up`: also the Kueue controller (gang admission; its CRDs and webhooks); `build`: only Kueue",
    )
    cluster.add_argument("--job", help="`scrape`: the job label of the targets (e.g. rankwatch-operator)")
    cluster.add_argument(
        "--target", action="append", default=[], help="`scrape`: HOST:PORT serving /metrics (repeatable)"
    )
    cluster.add_argument(
        "--webhook", help="`route-alerts`: Alertmanager webhook for P0-P3 alerts, e.g. .../alerting/alertmanager"
    )
    cluster.add_argument("--bearer-token-file", help="`route-alerts`: the webhook's bearer token, from this file")
    cluster.add_argument(
        "--collector-url",
        help="`run-pods`: the operator's collector as this machine reaches it, e.g. http://127.0.0.1:8080",
    )
    cluster.add_argument(
        "--collector-service",
        metavar="NAMESPACE/NAME",
        help="`run-pods`: also run rankwatch's operator pods (from the Helm chart) in the namespaces given, and "
        "send the sidecars to this Service through a local proxy to its ready endpoints, as kube-proxy would",
    )
    cluster.add_argument(
        "--namespace", "-n", action="append", default=[], help="`run-pods`: only these namespaces (repeatable)"
    )
    cluster.add_argument("--work-dir", help="`run-pods`: volumes and logs of the pods (default ~/.rankwatch/pods)")
    cluster.set_defaults(handler=_cluster)

    operator = commands.add_parser(
        "operator",
        help="run the TrainingJob operator (settings: RANKWATCH_* environment, see docs/running-the-operator.md)",
        description="Replicas elect a leader through a coordination.k8s.io Lease (RANKWATCH_LEASE_NAME in "
        "RANKWATCH_LEASE_NAMESPACE, default $POD_NAMESPACE); only the leader acts and reports ready.",
    )
    operator.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help="watch only these namespaces (globs allowed; repeatable); default: all",
    )
    operator.add_argument(
        "--standalone",
        action="store_true",
        help="no leader election: this process acts at once (one replica only; development and tests)",
    )
    operator.set_defaults(handler=_operator)

    simulate = commands.add_parser(
        "simulate", help="run a Megatron-shaped job on the stand-in NCCL with the tracer preloaded"
    )
    simulate.add_argument("--world-size", type=int, required=True, help="ranks (processes) to run")
    simulate.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    simulate.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    simulate.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    simulate.add_argument(
        "--microbatches", type=int, default=2, help="microbatches per step, through the pipeline (default 2)"
    )
    simulate.add_argument(
        "--compute-us", type=int, default=2000, help="GPU compute per chunk, microseconds (default 2000)"
    )
    simulate.add_argument(
        "--ranks-per-node", type=int, default=8, help="ranks per simulated node, for node names (default 8)"
    )
    simulate.add_argument(
        "--gpu-timing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GPU start/end of each call via the stand-in libcuda (default on, as spec.tracing.gpuTiming)",
    )
    _add_device_arguments(simulate, default="async")
    simulate.add_argument("--slow-rank", type=int, help="fault: this rank computes slower (see --slowdown)")
    simulate.add_argument("--slowdown", type=float, default=0.0, help="e.g. 0.2: compute 20%% slower")
    simulate.add_argument("--slow-from-call", type=int, default=0, help="the slowdown starts at this NCCL call")
    simulate.add_argument("--hang-rank", type=int, help="fault: this rank stops calling NCCL (see --hang-at)")
    simulate.add_argument("--hang-at", type=int, default=0, help="the rank never makes its N-th NCCL call")
    simulate.add_argument(
        "--stuck-rank", type=int, help="fault: one NCCL operation of this rank never starts on its GPU (--stuck-at)"
    )
    simulate.add_argument(
        "--stuck-at", type=int, default=0, help="the rank's N-th NCCL operation never starts on its GPU (peers' do)"
    )
    simulate.add_argument(
        "--slow-link",
        type=int,
        nargs=2,
        metavar=("RANK_A", "RANK_B"),
        help="fault: sends between these two ranks are slower (see --link-latency-us)",
    )
    simulate.add_argument(
        "--link-latency-us", type=int, default=0, help="added latency of each send on the slow link, microseconds"
    )
    simulate.add_argument(
        "--device-stop-rank", type=int, help="fault: this rank's GPU stops (see --device-stop-at-kernel)"
    )
    simulate.add_argument(
        "--device-stop-at-kernel", type=int, default=0, help="the rank's GPU stops in its N-th compute kernel"
    )
    simulate.add_argument(
        "--mismatch-rank",
        type=int,
        help="fault: this rank calls another collective than its peers (see --mismatch-at, --mismatch)",
    )
    simulate.add_argument(
        "--mismatch-at", type=int, default=0, help="its first all-reduce from its N-th NCCL call on is the odd one"
    )
    simulate.add_argument(
        "--mismatch",
        choices=("op", "count", "dtype"),
        default="op",
        help="what differs: op (a broadcast where its peers all-reduce), count (half the elements) or dtype",
    )
    simulate.add_argument(
        "--timeout", type=float, default=300.0, help="seconds before a run that does not finish is stopped"
    )
    simulate.add_argument("--out", required=True, help="directory for the ring files and simulation.json")
    simulate.set_defaults(handler=_simulate)

    simulate_pod = commands.add_parser(
        "simulate-pod",
        help="a worker pod's ranks of the Megatron-shaped driver (as torchrun would start them), from the "
        "operator's env (NODE_RANK, NPROC_PER_NODE, WORLD_SIZE); RANKWATCH_STANDIN_* faults on the rank "
        "RANKWATCH_STANDIN_FAULT_RANK names",
    )
    simulate_pod.add_argument("--tp", type=int, default=1)
    simulate_pod.add_argument("--pp", type=int, default=1)
    simulate_pod.add_argument("--steps", type=int, default=10)
    simulate_pod.add_argument("--microbatches", type=int, default=2)
    simulate_pod.add_argument("--compute-us", type=int, default=2000)
    simulate_pod.add_argument(
        "--python", action="store_true", help="ranks are a Python training loop (a trainer with Python stacks)"
    )
    _add_device_arguments(simulate_pod, default=None)
    simulate_pod.set_defaults(handler=_simulate_pod)

    sidecar = commands.add_parser(
        "sidecar", help="follow a pod's trace rings: stall watch, window summaries to the collector, /metrics, /dump"
    )
    from rankwatch.sidecar.config import add_arguments

    add_arguments(sidecar)
    sidecar.set_defaults(handler=_sidecar)

    analyze = commands.add_parser("analyze", help="find the rank behind a hang or a slowdown in traces")
    analyze.add_argument(
        "path",
        nargs="?",
        help="a directory of *.ring files (or Megatrace logs, flight-recorder dumps, MegaScan traces), one ring, "
        "one MegaScan aggregated .json, or an archive "
        "the operator kept: its directory or s3://bucket/prefix (the newest archive below it)",
    )
    analyze.add_argument(
        "--s3-endpoint", help="an S3-compatible server for s3:// archives (default: $AWS_ENDPOINT_URL_S3, AWS)"
    )
    analyze.add_argument("--log-path", help="same as PATH (Megatrace's spelling)")
    analyze.add_argument("--test-type", default="all", choices=["all", "hang", "slow", "parallel"])
    analyze.add_argument(
        "--stall-seconds", type=float, default=1.0, help="a call pending this long at the end of the trace waits"
    )
    analyze.add_argument(
        "--seen-until",
        metavar="TIME",
        help="now or an ISO 8601 time (UTC) at which the job was seen still running, e.g. hung: logs that "
        "simply end (Megatrace) are then judged as watched until it, so a rank silent since is a hang",
    )
    analyze.add_argument("--json", metavar="OUT", help="write the findings as JSON (- : standard output)")
    analyze.add_argument(
        "--chrome-trace", metavar="OUT", help="write a Perfetto / chrome://tracing timeline (- : standard output)"
    )
    analyze.add_argument(
        "--html", metavar="OUT", help="write a self-contained HTML report with plots (- : standard output)"
    )
    analyze.add_argument("--tp", type=int, help="tensor-parallel size (Megatron order: tp fastest, then dp, pp)")
    analyze.add_argument("--pp", type=int, help="pipeline-parallel size")
    analyze.add_argument(
        "--world-size", type=int, help="ranks in the job (default: what the ring headers record); checked against them"
    )
    analyze.add_argument("--config-path", help="Megatrace's config.yaml with TP, PP, world_size")
    analyze.add_argument("--ranks-per-node", type=int, help="name nodes when the traces do not")
    analyze.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="processes reading rings")
    analyze.set_defaults(handler=_analyze)

    uncordon = commands.add_parser(
        "uncordon", help="undo rankwatch's cordon of nodes: taint off, schedulable again unless it was before"
    )
    uncordon.add_argument("node", nargs="*", help="node names")
    uncordon.add_argument(
        "--all-from-job", metavar="NAMESPACE/NAME", help="every node rankwatch marked for this TrainingJob"
    )
    uncordon.add_argument("--kubeconfig", help="default: in-cluster ServiceAccount, else $KUBECONFIG")
    uncordon.set_defaults(handler=_uncordon)

    nodes = commands.add_parser(
        "nodes",
        help="the nodes rankwatch cordoned (or marked in a dry run): for which job, since when, why",
        description="Read back from the nodes' rankwatch.io/ annotations and taint, the only record of what "
        "rankwatch did; `rankwatch uncordon` undoes it.",
    )
    nodes.add_argument("--job", metavar="NAMESPACE/NAME", help="only the nodes marked for this TrainingJob")
    nodes.add_argument("--output", "-o", choices=("table", "json"), default="table")
    nodes.add_argument("--kubeconfig", help="default: in-cluster ServiceAccount, else $KUBECONFIG")
    nodes.set_defaults(handler=_nodes)

    describe = commands.add_parser(
        "describe",
        help="what rankwatch found about a job of any kind it watches: health, suspects, the diagnosis, Events",
        description="As `kubectl describe trainingjob` for a TrainingJob; for an Indexed Job or a JobSet, read "
        "from the annotations and Events rankwatch wrote on it. Also `kubectl rankwatch describe ...`.",
    )
    describe.add_argument(
        "reference", metavar="KIND/NAME", help="trainingjob/llama, job/bert, jobset/gpt (or tj/, js/)"
    )
    describe.add_argument("--namespace", "-n", default="default")
    describe.add_argument("--kubeconfig", help="default: in-cluster ServiceAccount, else $KUBECONFIG")
    describe.set_defaults(handler=_describe)

    alerts = commands.add_parser(
        "alerts",
        help="alerting: the weekly report or a test message now, silences, or serve the Alertmanager intake alone",
    )
    alerts.set_defaults(handler=_alerts)
    alert_actions = alerts.add_subparsers(dest="action", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", help="alerting config YAML (default $RANKWATCH_ALERTING_CONFIG)")
    common.add_argument(
        "--secrets", help="YAML {secret-name: {key: value}} instead of reading Secrets from the cluster"
    )
    common.add_argument(
        "--namespace", "-n", help="namespace of the Secrets (default $POD_NAMESPACE or rankwatch-system)"
    )
    report = alert_actions.add_parser("report", parents=[common], help="send the weekly report now")
    report.add_argument("--store", help="a SQLite alert store file (default: the config's store, e.g. its ConfigMaps)")
    report.add_argument("--receiver", help="instead of the config's report.receiver")
    report.add_argument("--print", action="store_true", help="print the card JSON, send nothing")
    test = alert_actions.add_parser("test", parents=[common], help="send a test message to a receiver now")
    test.add_argument("--receiver", required=True, help="the receiver to test")
    test.add_argument("--level", default="P3", help="level of the test message (P0 on a phone receiver rings)")
    serve = alert_actions.add_parser(
        "serve", parents=[common], help="the Alertmanager intake and the P0-P3 pipeline without the operator"
    )
    serve.add_argument(
        "--listen", default="127.0.0.1:8081", help="HOST:PORT of the intake and /metrics (port 0: any free)"
    )
    silence = alert_actions.add_parser(
        "silence",
        help="add, list or remove silences in the running pipeline (through its intake)",
        description="Silences mute the alerts whose labels (and level) match all their matchers, from their "
        "start (default now) to their end. The commands talk to the intake of the operator or of "
        "`rankwatch alerts serve`, e.g. after `kubectl -n rankwatch-system port-forward "
        "svc/<release>-rankwatch-intake 8081`.",
    )
    silence_actions = silence.add_subparsers(dest="silence_action", required=True)
    intake = argparse.ArgumentParser(add_help=False)
    intake.add_argument("--url", help="the intake, e.g. http://127.0.0.1:8081/alerting (default $RANKWATCH_INTAKE_URL)")
    intake.add_argument(
        "--token-file", help="file holding the intake's bearer token (default: $RANKWATCH_INTAKE_TOKEN)"
    )
    add = silence_actions.add_parser("add", parents=[intake], help="add a silence; prints its id")
    add.add_argument(
        "matchers",
        nargs="+",
        metavar="MATCHER",
        help='label matchers, e.g. node="gpu-node-3" alertname=~"TrainingJob.*"',
    )
    add.add_argument("--duration", "-d", help="how long from its start, e.g. 30m, 2h, 1h30m, 7d")
    add.add_argument("--ends-at", help="its end, RFC 3339 (instead of --duration)")
    add.add_argument(
        "--starts-at", help="its start, RFC 3339, e.g. 2026-12-01T08:00:00Z (default now; nothing is muted before)"
    )
    add.add_argument("--comment", "-c", default="", help="why (shown in ls)")
    add.add_argument("--created-by", help="who (default: your user name)")
    ls = silence_actions.add_parser("ls", parents=[intake], help="list silences (active and pending)")
    ls.add_argument("--output", "-o", choices=("table", "json"), default="table")
    rm = silence_actions.add_parser("rm", parents=[intake], help="expire a silence now")
    rm.add_argument("id", help="the silence's id (from add or ls)")
    return parser


DEVELOPMENT_MODULES = ("rankwatch.cluster", "rankwatch.standins")
"""Development and test tools, not installed in the runtime image (see the Dockerfile)."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except Exception as error:  # no kubeconfig or an API server away: one line, not the library's traceback
        if isinstance(error, ModuleNotFoundError):
            return _missing_module(args, error)
        if "kubernetes" not in sys.modules:
            raise
        from rankwatch.kube import connection_problem

        problem = connection_problem(error)
        if problem is None:
            raise
        print(f"rankwatch {args.command}: {problem}", file=sys.stderr)
        return 1


def _missing_module(args: argparse.Namespace, error: ModuleNotFoundError) -> int:
    if not (error.name or "").startswith(DEVELOPMENT_MODULES):
        raise error
    print(
        f"rankwatch {args.command}: {error.name} is a development tool, not part of this installation "
        "(the runtime image leaves it out); install rankwatch from its source tree for it",
        file=sys.stderr,
    )
    return 2
