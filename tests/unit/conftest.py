"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml


@pytest.fixture
def loopback_kubeconfig(tmp_path: Path) -> Callable[[int], str]:
    """A kubeconfig (plain HTTP, a bearer token) for a test's own API server on a loopback port."""

    def write(port: int) -> str:
        path = tmp_path / f"kubeconfig-{port}"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "c",
        }
        path.write_text(yaml.safe_dump(config))
        return str(path)

    return write
