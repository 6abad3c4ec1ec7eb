"""Fixtures every test folder may use."""

from __future__ import annotations

import pytest

from rankwatch.operator.operator_metrics import OperatorMetrics


@pytest.fixture(scope="session")
def operator_metrics() -> OperatorMetrics:
    """The operator's series on the process's registry (what /metrics serves), made once per process as
    the operator makes them at its start."""
    return OperatorMetrics.create()
