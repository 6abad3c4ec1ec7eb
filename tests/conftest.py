"""Fixtures every test folder may use."""

from __future__ import annotations

import pytest

from rankwatch.operator.operator_metrics import OperatorMetrics


@pytest.fixture(scope="session")
def operator_metrics() -> OperatorMetrics:
    """The operator's series on the process's registry (what /metrics serves), as the operator's start
    makes them (the same objects when the e2e tests' in-process operator made them first)."""
    return OperatorMetrics.of()
