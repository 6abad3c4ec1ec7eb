"""A controller built from its Go module (JobSet, Kubeflow Trainer, the training-operator) run out of
cluster against the local cluster: its CRDs applied until Established, the controller started with its
configuration file (or flags) and ready when ``/readyz`` answers, its admission webhooks (served on
loopback) registered for one namespace; ``stop`` removes the registrations and ends the process."""

from __future__ import annotations

import base64
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from rankwatch.cluster import binaries


def serve_on_loopback(webhook: dict[str, Any], url: str, ca_bundle: bytes, namespace: str) -> None:
    """Point a controller's webhook (as its manifests register it, on a Service) at ``url`` on loopback, for
    ``namespace`` only, so a test's controller never answers for another namespace."""
    webhook["clientConfig"] = {"url": url, "caBundle": base64.b64encode(ca_bundle).decode()}
    webhook["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}


class LoopbackController:
    """What every controller run here shares; a subclass says what it is (``title``) and starts it."""

    title = "controller"  # "JobSet controller", "Trainer controller": for messages and the log's name

    def __init__(self, kubeconfig: str, namespace: str, work_dir: Path) -> None:
        self.kubeconfig, self.namespace, self.work_dir = kubeconfig, namespace, work_dir
        self.process: subprocess.Popen | None = None
        self.configurations: list[dict[str, Any]] = []

    def _kubectl(self, *args: str, input: str | None = None) -> None:
        subprocess.run(
            [str(binaries.binary_path("kubectl")), "--kubeconfig", self.kubeconfig, *args],
            input=input,
            capture_output=True,
            text=True,
            check=True,
        )

    def _install_crds(self, files: list[Path], names: list[str], patience_s: float) -> None:
        """Apply the CRDs until each is Established. Right after another controller's CRDs were removed
        (the Kueue e2e's) the first apply and wait failed once; the next one held."""
        deadline = time.monotonic() + patience_s
        while True:
            try:
                self._kubectl("apply", "--server-side", "--force-conflicts", *(f"--filename={f}" for f in files))
                for name in names:
                    self._kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=30s")
                return
            except subprocess.CalledProcessError as error:
                if time.monotonic() >= deadline:
                    why = error.stderr.strip()[-500:]
                    raise RuntimeError(f"the {self.title}'s CRDs were not Established: {why}") from None
                time.sleep(2)

    def _run(
        self, binary: Path, config: dict[str, Any] | None, health_port: int, patience_s: float,
        env: Mapping[str, str] | None = None, flags: Sequence[str] = (),
    ) -> None:  # fmt: skip
        """Start ``binary`` with ``config`` as its configuration file (None: a controller configured by
        ``flags`` only, the training-operator); return once it is ready."""
        argv = [str(binary), "--kubeconfig", self.kubeconfig, *flags]
        if config is not None:
            (self.work_dir / "config.yaml").write_text(yaml.safe_dump(config))
            argv[1:1] = ["--config", str(self.work_dir / "config.yaml")]
        log_name = self.title.lower().replace(" ", "-") + ".log"
        log = open(self.work_dir / log_name, "ab")  # noqa: SIM115 (the child holds it)
        self.process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        log.close()
        deadline = time.monotonic() + patience_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the {self.title} exited ({self.process.returncode}); see {self.work_dir}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/readyz", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the {self.title} was not ready within {patience_s:.0f} s; see {self.work_dir}")

    def _register(self, configurations: list[dict[str, Any]]) -> None:
        self.configurations = configurations
        self._kubectl("apply", "-f", "-", input=yaml.safe_dump_all(configurations))

    def stop(self) -> None:
        for configuration in self.configurations:
            kind = configuration["kind"].lower()
            self._kubectl("delete", kind, configuration["metadata"]["name"], "--ignore-not-found")
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
