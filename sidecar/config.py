"""The sidecar's settings: the environment the operator injects (operator/lifecycle/pod_spec.py), overridden by
``rankwatch sidecar`` flags."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rankwatch import sidecar_env as env
from rankwatch.config_error import ConfigError


@dataclass(frozen=True)
class SidecarConfig:
    trace_dir: Path
    collector_url: str | None  # None: summaries are only logged (local use)
    token_file: Path | None
    namespace: str
    job: str
    pod: str
    node: str
    replica_index: int
    nproc_per_node: int
    sensitivity_s: float | None  # None: each ring's own (RANKWATCH_SENSITIVITY_SECONDS of the trainer)
    window_s: float
    host: str
    port: int
    poll_s: float
    queue_size: int
    post_timeout_s: float
    shutdown_grace_s: float
    python_stacks: int  # 1: take the ranks' Python stacks (py-spy) for each stall report; 0: never
    idle_timeout_s: float = 15.0  # a connection without a complete request for this long is closed


# field -> (flag, environment variable or None, type, default)
SETTINGS: dict[str, tuple[str, str | None, type, object]] = {
    "trace_dir": ("--trace-dir", env.TRACE_DIR, Path, Path("/tmp/rankwatch-traces")),
    "collector_url": ("--collector-url", env.COLLECTOR_URL, str, None),
    "token_file": ("--token-file", env.TOKEN_FILE, Path, None),
    "namespace": ("--namespace", env.JOB_NAMESPACE, str, "default"),
    "job": ("--job", env.JOB_NAME, str, "unknown"),
    "pod": ("--pod", env.POD_NAME, str, ""),
    "node": ("--node", env.NODE_NAME, str, ""),
    "replica_index": ("--replica-index", env.REPLICA_INDEX, int, 0),
    "nproc_per_node": ("--nproc-per-node", env.NPROC_PER_NODE, int, 0),
    "sensitivity_s": ("--sensitivity-seconds", env.SENSITIVITY_SECONDS, float, None),
    "window_s": ("--window-seconds", env.WINDOW_SECONDS, float, 5.0),
    "host": ("--host", None, str, "0.0.0.0"),
    "port": ("--port", env.METRICS_PORT, int, 9400),
    "poll_s": ("--poll-seconds", None, float, 0.5),
    "queue_size": ("--queue-size", None, int, 120),
    "post_timeout_s": ("--post-timeout-seconds", None, float, 10.0),
    "shutdown_grace_s": ("--shutdown-grace-seconds", None, float, 5.0),
    "python_stacks": ("--python-stacks", env.PYTHON_STACKS, int, 1),
    "idle_timeout_s": ("--idle-timeout-seconds", None, float, 15.0),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for name, (flag, variable, _, default) in SETTINGS.items():
        source = f"${variable}; " if variable else ""
        parser.add_argument(flag, dest=name, default=None, help=f"{source}default {default}")


def load(arguments: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None) -> SidecarConfig:
    """Flags first, then the environment, then the defaults; ConfigError names the bad setting."""
    environ = os.environ if environ is None else environ
    values = {}
    for name, (flag, variable, kind, default) in SETTINGS.items():
        given = getattr(arguments, name, None) if arguments is not None else None
        source = flag if given is not None else variable
        raw = given if given is not None else environ.get(variable) if variable else None
        if raw is None or raw == "":
            values[name] = default
            continue
        try:
            values[name] = kind(raw)
        except ValueError as error:
            raise ConfigError(f"{source}={raw!r}: expected {kind.__name__}") from error
    config = SidecarConfig(**values)
    if config.window_s <= 0 or config.poll_s <= 0:
        raise ConfigError(f"window ({config.window_s}) and poll ({config.poll_s}) seconds must be positive")
    if config.sensitivity_s is not None and config.sensitivity_s <= 0:
        raise ConfigError(f"sensitivity must be positive seconds, got {config.sensitivity_s}")
    if config.queue_size < 1:
        raise ConfigError(f"--queue-size must be at least 1, got {config.queue_size}")
    if config.collector_url and not config.collector_url.startswith(("http://", "https://")):
        raise ConfigError(f"RANKWATCH_COLLECTOR_URL / --collector-url {config.collector_url!r} is not an http(s) URL")
    return config


class TokenSource:
    """The job's bearer token, re-read when the mounted Secret changes (Kubernetes updates it in place)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._token: str | None = None

    def __call__(self) -> str | None:
        if self.path is None:
            return None
        try:
            stat = self.path.stat()
            stamp = (stat.st_mtime_ns, stat.st_ino)
            if stamp != self._stamp:
                self._token = self.path.read_text().strip() or None
                self._stamp = stamp
        except OSError:
            self._token, self._stamp = None, None
        return self._token
