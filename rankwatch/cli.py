"""The `rankwatch` command: one entry point whose subcommands call into the packages."""

from __future__ import annotations

import argparse
import json
import sys


def _cluster(args: argparse.Namespace) -> int:
    from rankwatch.cluster.binaries import BuildError
    from rankwatch.cluster.local import ClusterError, LocalCluster

    cluster = LocalCluster()
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    try:
        if args.action == "up":
            cluster.up(nodes=args.nodes, log=log, timeout=args.timeout)
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

            for name, path in ensure_all(log).items():
                print(f"{name}\t{path}")
    except (ClusterError, BuildError) as error:
        print(f"rankwatch cluster {args.action}: {error}", file=sys.stderr)
        return 1
    return 0


def _operator(args: argparse.Namespace) -> int:
    from rankwatch.operator.main import run

    return run(namespaces=args.namespace, standalone=args.standalone, liveness=args.liveness)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rankwatch", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    cluster = commands.add_parser("cluster", help="the built-in local Kubernetes cluster (no containers)")
    cluster.add_argument("action", choices=["up", "down", "status", "kubeconfig", "build"])
    cluster.add_argument("--nodes", type=int, default=4, help="fake GPU nodes (8 GPUs each) for `up`")
    cluster.add_argument("--timeout", type=float, default=180.0, help="seconds `up` waits for readiness")
    cluster.set_defaults(handler=_cluster)

    operator = commands.add_parser("operator", help="run the TrainingJob operator")
    operator.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help="watch only these namespaces (globs allowed; repeatable); default: all",
    )
    operator.add_argument("--standalone", action="store_true", help="no peering with other operator replicas")
    operator.add_argument("--liveness", default=None, help="serve a liveness probe, e.g. http://0.0.0.0:8081/healthz")
    operator.set_defaults(handler=_operator)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)
