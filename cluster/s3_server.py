"""A real S3-compatible server on loopback (MinIO, built from its Go module like the cluster binaries),
for the archive tests and local use: ``with S3Server(directory) as s3: s3.endpoint, s3.access_key``.

Listens on 127.0.0.1 only, on free ports; the credentials are random per start and are only handed
to the caller (never logged). The data lives in ``directory`` and goes with it.
"""

from __future__ import annotations

import secrets
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from rankwatch.cluster import processes
from rankwatch.cluster.binaries import ensure_component
from rankwatch.cluster.ports import free_ports
from rankwatch.cluster.versions import MINIO

READY_TIMEOUT_S = 60.0


class S3ServerError(RuntimeError):
    """The server did not start; the message carries its log's tail."""


class S3Server:
    def __init__(self, directory: Path, port: int = 0) -> None:
        """``port`` 0: a free one (give one when the endpoint must be known before the server starts,
        as the operator's archive endpoint allow-list is)."""
        self.directory = directory
        self.access_key = "rankwatch-" + secrets.token_hex(4)
        self.secret_key = secrets.token_urlsafe(24)
        self.port = port
        self.pid = 0
        self.executable: Path | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.directory / "minio.log"

    def start(self) -> S3Server:
        self.executable = ensure_component(MINIO) / "minio"
        if self.port:
            (console,) = free_ports(1)
        else:
            self.port, console = free_ports(2)
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        env = {
            "MINIO_ROOT_USER": self.access_key,
            "MINIO_ROOT_PASSWORD": self.secret_key,
            "MINIO_BROWSER": "off",
            "MINIO_UPDATE": "off",
            "HOME": str(self.directory),
        }
        argv = [str(self.executable), "server", str(data), "--address", f"127.0.0.1:{self.port}",
                "--console-address", f"127.0.0.1:{console}"]  # fmt: skip
        self.pid = processes.start(argv, self.log_path, env).pid
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.endpoint}/minio/health/ready", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if not processes.is_running(self.pid, self.executable):
                break
            time.sleep(0.2)
        self.stop()
        raise S3ServerError(f"MinIO did not become ready on {self.endpoint}:\n{processes.log_tail(self.log_path)}")

    def stop(self) -> None:
        if self.pid and self.executable:
            processes.stop(self.pid, self.executable)
        self.pid = 0

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()
