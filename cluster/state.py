"""The local cluster's state directory and what `up` decided in it (ports, pids): shared by the control
plane (``local``) and the monitoring stack (``monitoring``), which starts beside it."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rankwatch.cluster import ports

DEFAULT_NODES = 4


class ClusterError(RuntimeError):
    """The local cluster could not be brought to the requested state; the message says why."""


def cluster_dir() -> Path:
    return Path(os.environ.get("RANKWATCH_CLUSTER_DIR") or os.path.expanduser("~/.rankwatch/cluster"))


@dataclass
class ClusterState:
    """What `up` decided once (ports) and what it started (pids); persisted as state.json."""

    ports: dict[str, int] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    nodes: int = DEFAULT_NODES

    @classmethod
    def load(cls, path: Path) -> ClusterState | None:
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as error:
            raise ClusterError(f"{path} is not a cluster state file ({error}); run `rankwatch cluster down`") from error

    def save(self, path: Path) -> None:
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(asdict(self), indent=2))
        temporary.replace(path)


def free_ports_by_name(names: list[str], avoid: set[int] | None = None) -> dict[str, int]:
    """Distinct free loopback ports by name, chosen once and kept in state.json (see ``ports``)."""
    try:
        return dict(zip(names, ports.free_ports(len(names), avoid or ()), strict=True))
    except ports.NoFreePort as error:
        raise ClusterError(str(error)) from None


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the Go servers bind
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
