"""Loopback ports for the local cluster's processes, chosen below the kernel's ephemeral range.

A port from ``bind(0)`` comes from the ephemeral range, where the kernel may hand it to some outgoing
connection (a rank's, a client's) before the process it was chosen for binds it: with dozens of pods
starting at once that happens. A port below the range is never given out that way; a random one,
checked by binding it and never handed out twice by the caller, leaves only a race with another
chooser, which the random choice makes unlikely.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection
from pathlib import Path

LOWEST = 20000


class NoFreePort(RuntimeError):
    pass


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int, avoid: Collection[int] = ()) -> list[int]:
    """``count`` distinct loopback ports free now, below the ephemeral range, none of ``avoid``."""
    top = max(_ephemeral_low(), LOWEST + 4 * count)
    ports: list[int] = []
    for candidate in random.sample(range(LOWEST, top), k=min(top - LOWEST, 200 + 4 * count)):
        if len(ports) == count:
            break
        if candidate in avoid or candidate in ports:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", candidate))
            except OSError:
                continue
        ports.append(candidate)
    if len(ports) < count:
        raise NoFreePort("could not find free loopback ports below the ephemeral range")
    return ports


def free_port(avoid: Collection[int] = ()) -> int:
    return free_ports(1, avoid)[0]
