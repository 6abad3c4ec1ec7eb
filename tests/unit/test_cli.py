"""The `rankwatch` command as a person meets it first: its version, help on every flag, one line (not a
traceback) when there is no cluster to talk to, and `simulate` saying what happened."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import version

from rankwatch.cli import build_parser


def rankwatch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rankwatch", *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_version_is_the_installed_distributions():
    result = rankwatch("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"rankwatch {version('rankwatch')}"


def test_every_simulate_flag_has_help():
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    simulate = subcommands.choices["simulate"]
    unexplained = [a.option_strings[0] for a in simulate._actions if a.option_strings and not a.help]
    assert unexplained == []


def test_a_missing_kubeconfig_is_one_line(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no $KUBECONFIG, no ~/.kube/config, not a pod
    result = rankwatch("uncordon", "gpu-node-1", env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "rankwatch uncordon: no kubeconfig: ~/.kube/config ($KUBECONFIG is unset): no such file, and this is "
        "not a pod with a ServiceAccount; give --kubeconfig FILE or set KUBECONFIG"
    )
    result = rankwatch("nodes", "--kubeconfig", str(tmp_path / "absent.yaml"), env=env)
    assert result.returncode == 1
    assert result.stderr.strip().startswith(f"rankwatch nodes: no kubeconfig: --kubeconfig {tmp_path / 'absent.yaml'}")
    broken = tmp_path / "broken.yaml"
    broken.write_text("clusters: [\n")
    result = rankwatch("nodes", "--kubeconfig", str(broken), env=env)
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
    assert f"kubeconfig {broken} cannot be used" in result.stderr


def test_an_api_server_that_is_away_is_one_line(tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: away\n"
        "clusters: [{name: away, cluster: {server: 'https://127.0.0.1:9'}}]\n"  # port 9 (discard): nobody listens
        "users: [{name: me, user: {token: t}}]\n"
        "contexts: [{name: away, context: {cluster: away, user: me}}]\n"
    )
    result = rankwatch("nodes", "--kubeconfig", str(kubeconfig))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [
        "rankwatch nodes: cannot reach the Kubernetes API server at https://127.0.0.1:9: [Errno 111] Connection refused"
    ]


def test_simulate_without_a_fault_does_not_speak_of_a_hang(tmp_path):
    result = rankwatch("simulate", "--world-size", "2", "--steps", "2", "--device", "sync", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"2 ranks, all finished; rings in {tmp_path}"
