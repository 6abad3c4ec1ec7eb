"""Fixtures every test folder may use."""

from __future__ import annotations

import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from rankwatch.operator.operator_metrics import OperatorMetrics


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
