"""Fixtures every test folder may use."""

from __future__ import annotations

import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rankwatch.operator.operator_metrics import OperatorMetrics

LOCAL_CLUSTER = "local-cluster"


def distribution_group(nodeid: str) -> str:
    """The group a test runs in under ``make test``'s two workers: every e2e test in one (only one worker
    ever brings up the local cluster in $RANKWATCH_TEST_CLUSTER_DIR), every other file a group of its
    own (its module-scoped fixtures, real runs and built probes, run once)."""
    path = nodeid.partition("::")[0]
    return LOCAL_CLUSTER if path.startswith("tests/e2e/") else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's ``--dist loadgroup`` by :func:`distribution_group`: a group runs whole on one worker.
    Not by ``xdist_group`` marks: pytest-xdist 3.8 marks a test by renaming it, which pytest 9.2 ignores."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByDistributionGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return distribution_group(nodeid)

    return ByDistributionGroup(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On ``make test``'s workers the e2e tests come first: the e2e group goes to one worker at the start
    and keeps it waiting on the cluster while the other computes; only the last files of the run (as
    before, after the e2e tests) may land on it afterwards. A plain ``pytest`` run keeps its order."""
    if config.getoption("loadgroup", False):
        items.sort(key=lambda item: distribution_group(item.nodeid) != LOCAL_CLUSTER)


@pytest.fixture(scope="session")
def operator_metrics() -> OperatorMetrics:
    """The operator's series on the process's registry (what /metrics serves), as the operator's start
    makes them (the same objects when the e2e tests' in-process operator made them first)."""
    return OperatorMetrics.of()


@pytest.fixture(scope="session")
def unpacked(tmp_path_factory) -> Callable[[Path], Path]:
    """Unpacks a kept archive of real inputs (dumps, rings, published traces) once per session, with its
    files' modification times (when each dump was written): tests only read what it holds."""
    directories: dict[Path, Path] = {}

    def unpack(archive: Path) -> Path:
        if archive not in directories:
            directory = tmp_path_factory.mktemp(archive.name.split(".")[0])
            with tarfile.open(archive) as opened:
                opened.extractall(directory, filter="data")
            directories[archive] = directory
        return directories[archive]

    return unpack
