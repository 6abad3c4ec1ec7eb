"""The real Kubeflow training-operator v1 (github.com/kubeflow/training-operator, built from its Go module and
cached like the cluster's binaries) run against the local cluster, its PyTorchJob controller only, for the
tests of PyTorchJob groups.

Out of cluster, as the JobSet controller and the Trainer are run, but it has no configuration file: flags
only (its metrics off, its health probe and webhook server on free ports, its cache and controller for one
namespace). Its certificate rotator cannot be turned off: it keeps a CA and a certificate for
``training-operator.<namespace>.svc`` in a Secret of ``MY_POD_NAMESPACE`` (made here, empty, in the test's
namespace; the rotator fills it), tries to put that CA into a ValidatingWebhookConfiguration of a fixed
name (absent here: it logs so and goes on) and waits for ``tls.crt`` at a fixed path
(``/tmp/k8s-webhook-server/serving-certs``) it never reads. The webhook server reads its certificate from
controller-runtime's default directory under ``TMPDIR`` (the controller's own work directory): a
certificate for 127.0.0.1 made here, which the local API server (on this host) verifies; the rotator's
fixed path gets a copy of it when nothing is there. Its only PyTorchJob webhook (validation; the
controller sets the defaults itself) is registered for the test's namespace. ``stop`` removes the
registration.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from rankwatch.cluster import binaries, pki, ports
from rankwatch.cluster.jobset import module_source
from rankwatch.cluster.loopback_controller import LoopbackController, serve_on_loopback
from rankwatch.cluster.versions import TRAINING_OPERATOR

CRD = "manifests/base/crds/kubeflow.org_pytorchjobs.yaml"
WEBHOOKS = "manifests/base/webhook/manifests.yaml"
WEBHOOK_PATH = "/validate-kubeflow-org-v1-pytorchjob"
SECRET = "training-operator-webhook-cert"
ROTATOR_CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")
"""Where the training-operator's certificate rotator waits for ``tls.crt`` (a constant of its ``pkg/cert``)."""


def module_dir() -> Path:
    return module_source("github.com/kubeflow/training-operator", TRAINING_OPERATOR.version)


def webhook_configuration(namespace: str, url: str, ca_bundle: bytes) -> dict[str, Any]:
    """The training-operator's PyTorchJob validation webhook aimed at ``url`` (its path kept), for
    ``namespace`` only; its webhooks of other kinds (TFJob, MXJob...) are left out."""
    [document] = [doc for doc in yaml.safe_load_all((module_dir() / WEBHOOKS).read_text()) if doc]
    configuration = copy.deepcopy(document)
    configuration["metadata"] = {"name": f"training-operator-{namespace}-{document['kind'].lower()}"}
    webhooks = [w for w in configuration["webhooks"] if w["clientConfig"]["service"]["path"] == WEBHOOK_PATH]
    for webhook in webhooks:
        serve_on_loopback(webhook, f"{url}{WEBHOOK_PATH}", ca_bundle, namespace)
    configuration["webhooks"] = webhooks
    return configuration


class TrainingOperatorController(LoopbackController):
    """``start`` installs the PyTorchJob CRD, runs the controller and registers its webhook until ``stop``."""

    title = "training-operator"

    def start(self, patience_s: float = 300) -> None:
        binary = binaries.ensure_component(TRAINING_OPERATOR) / "training-operator"
        self.work_dir.mkdir(parents=True, exist_ok=True)
        temp = self.work_dir / "tmp"
        certs = temp / "k8s-webhook-server" / "serving-certs"
        pki.issue_serving(certs, ["127.0.0.1"])
        if not (ROTATOR_CERT_DIR / "tls.crt").exists():
            ROTATOR_CERT_DIR.mkdir(parents=True, exist_ok=True)
            shutil.copy(certs / "tls.crt", ROTATOR_CERT_DIR / "tls.crt")
        webhook_port, health_port = ports.free_ports(2)
        self._install_crds([module_dir() / CRD], ["pytorchjobs.kubeflow.org"], patience_s)
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET, "namespace": self.namespace}}
        self._kubectl("apply", "-f", "-", input=yaml.safe_dump(secret))
        flags = [
            "--enable-scheme=pytorchjob",
            f"--namespace={self.namespace}",
            "--metrics-bind-address=0",
            f"--health-probe-bind-address=127.0.0.1:{health_port}",
            f"--webhook-server-port={webhook_port}",
            f"--webhook-secret-name={SECRET}",
        ]
        env = {**os.environ, "TMPDIR": str(temp), "MY_POD_NAMESPACE": self.namespace}
        self._run(binary, None, health_port, patience_s, env=env, flags=flags)
        url, ca = f"https://127.0.0.1:{webhook_port}", (certs / "ca.crt").read_bytes()
        self._register([webhook_configuration(self.namespace, url, ca)])
