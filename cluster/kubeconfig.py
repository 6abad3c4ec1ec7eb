"""Kubeconfig files for the local cluster's identities, self-contained (certificates embedded)."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import yaml

CONTEXT = "rankwatch-local"


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def render(server: str, pki: Path, stem: str) -> str:
    """A kubeconfig for client identity ``stem`` (see pki.CLIENTS) talking to ``server``."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": CONTEXT,
                "cluster": {"server": server, "certificate-authority-data": _b64(pki / "ca.crt")},
            }
        ],
        "users": [
            {
                "name": stem,
                "user": {
                    "client-certificate-data": _b64(pki / f"{stem}.crt"),
                    "client-key-data": _b64(pki / f"{stem}.key"),
                },
            }
        ],
        "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": stem}}],
        "current-context": CONTEXT,
    }
    return yaml.safe_dump(config, sort_keys=False)


def write(path: Path, server: str, pki: Path, stem: str) -> Path:
    """Write the kubeconfig readable by the owner only (it holds a private key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(render(server, pki, stem))
    return path
