"""Chart, rules and image tests: helm and promtool are built from their Go modules on first use and
cached like the cluster binaries (``rankwatch cluster build --tools``, ``make tools``)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_support import CHART, KUBE_VERSION


@pytest.fixture(scope="session")
def helm_path() -> Path:
    from rankwatch.cluster.binaries import ensure_tool

    return ensure_tool("helm")


@pytest.fixture(scope="session")
def promtool_path() -> Path:
    from rankwatch.cluster.binaries import ensure_tool

    return ensure_tool("promtool")


@pytest.fixture(scope="session")
def helm(helm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., subprocess.CompletedProcess[str]]:
    # Helm keeps repositories, cache and plugins under these; a test must not touch the user's.
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
        "HOME": str(home),
        "PATH": "/usr/bin:/bin",
    }

    def run(*args: str, check: bool = True, kubeconfig: str | None = None) -> subprocess.CompletedProcess[str]:
        full_env = dict(env, KUBECONFIG=kubeconfig) if kubeconfig else env
        result = subprocess.run([str(helm_path), *args], env=full_env, capture_output=True, text=True, timeout=300)
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stderr}{result.stdout}")
        return result

    return run


@pytest.fixture(scope="session")
def render(helm: Callable[..., subprocess.CompletedProcess[str]]) -> Callable[..., list[dict[str, Any]]]:
    """``helm template`` the chart; return the rendered objects."""

    def run(*args: str, release: str = "rankwatch", namespace: str = "rankwatch-system") -> list[dict[str, Any]]:
        out = helm("template", release, str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION, *args)
        return [doc for doc in yaml.safe_load_all(out.stdout) if doc]

    return run
