"""Fixtures every test folder may use."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankwatch.operator.operator_metrics import OperatorMetrics


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for pytest-xdist's ``--dist loadgroup`` (``make test`` runs two workers); a group runs whole
    on one worker. The e2e tests are one group, so only one worker ever brings up the local cluster in
    $RANKWATCH_TEST_CLUSTER_DIR; every other file is a group of its own, so its module-scoped fixtures
    (real runs, built probes) run once. Under loadgroup the e2e group comes first: its worker spends
    the run waiting on the cluster while the other computes, and only the last files of the run (as
    before, after the e2e tests) may land on it afterwards. A plain ``pytest`` run keeps its order."""
    e2e = Path(__file__).parent / "e2e"

    def on_the_cluster(item: pytest.Item) -> bool:
        return Path(item.path).is_relative_to(e2e)

    for item in items:
        group = "local-cluster" if on_the_cluster(item) else item.nodeid.partition("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
    if config.getoption("loadgroup", False):
        items.sort(key=lambda item: not on_the_cluster(item))


@pytest.fixture(scope="session")
def operator_metrics() -> OperatorMetrics:
    """The operator's series on the process's registry (what /metrics serves), as the operator's start
    makes them (the same objects when the e2e tests' in-process operator made them first)."""
    return OperatorMetrics.of()
