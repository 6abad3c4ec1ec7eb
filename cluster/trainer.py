"""The real Kubeflow Trainer v2 controller (github.com/kubeflow/trainer/v2, built from its Go module and
cached like the cluster's binaries) run against the local cluster, for the tests of TrainJob groups.

A TrainJob becomes a JobSet of its name (the Trainer's ``jobset`` plugin), so the JobSet controller
(``cluster/jobset.py``) must run too. Out of cluster, as the JobSet controller is run: its CRDs from the
module's own manifests, leader election and its certificate rotation off, its admission webhooks
(TrainJob defaulting and validation, TrainingRuntime validation) served on loopback with a certificate
made here and registered for one namespace only. The Trainer has no setting for its certificate
directory: controller-runtime's default (``$TMPDIR/k8s-webhook-server/serving-certs``) is used, with
``TMPDIR`` the controller's own work directory. ``stop`` removes the registrations.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml

from rankwatch.cluster import binaries, pki, ports
from rankwatch.cluster.jobset import module_source
from rankwatch.cluster.loopback_controller import LoopbackController, serve_on_loopback
from rankwatch.cluster.versions import TRAINER

CRDS = "manifests/base/crds"
WEBHOOKS = "manifests/base/webhook/manifests.yaml"
TORCH_RUNTIME = "manifests/base/runtimes/torch_distributed.yaml"
CRD_NAMES = ("trainjobs", "trainingruntimes", "clustertrainingruntimes")


def module_dir() -> Path:
    return module_source("github.com/kubeflow/trainer/v2", TRAINER.version)


def torch_runtime(namespace: str) -> dict[str, Any]:
    """The Trainer's own ``torch-distributed`` runtime, as a TrainingRuntime of ``namespace`` (the release
    ships it as a ClusterTrainingRuntime; a namespaced one leaves nothing behind a test's namespace)."""
    runtime = yaml.safe_load((module_dir() / TORCH_RUNTIME).read_text())
    runtime["kind"] = "TrainingRuntime"
    runtime["metadata"]["namespace"] = namespace
    return runtime


def webhook_configurations(namespace: str, url: str, ca_bundle: bytes) -> list[dict[str, Any]]:
    """The Trainer's webhook configurations aimed at ``url`` (its paths kept), for ``namespace`` only;
    the one for cluster-scoped ClusterTrainingRuntimes is left out (no namespace would scope it)."""
    documents = [doc for doc in yaml.safe_load_all((module_dir() / WEBHOOKS).read_text()) if doc]
    configurations = []
    for document in documents:
        configuration = copy.deepcopy(document)
        configuration["metadata"] = {"name": f"trainer-{namespace}-{document['kind'].lower()}"}
        webhooks = []
        for webhook in configuration["webhooks"]:
            if any("clustertrainingruntimes" in rule.get("resources", []) for rule in webhook.get("rules", [])):
                continue
            path = webhook["clientConfig"]["service"]["path"]
            serve_on_loopback(webhook, f"{url}{path}", ca_bundle, namespace)
            webhooks.append(webhook)
        configuration["webhooks"] = webhooks
        configurations.append(configuration)
    return configurations


class TrainerController(LoopbackController):
    """``start`` installs the CRDs, serves and registers the webhooks, runs the controller until ``stop``."""

    title = "Trainer controller"

    def start(self, patience_s: float = 300) -> None:
        binary = binaries.ensure_component(TRAINER) / "trainer-controller-manager"
        self.work_dir.mkdir(parents=True, exist_ok=True)
        temp = self.work_dir / "tmp"
        certs = temp / "k8s-webhook-server" / "serving-certs"
        pki.issue_serving(certs, ["127.0.0.1"])
        webhook_port, health_port = ports.free_ports(2)
        config = {
            "apiVersion": "config.trainer.kubeflow.org/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "certManagement": {"enable": False},
            "webhook": {"host": "127.0.0.1", "port": webhook_port},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        }
        files = [module_dir() / CRDS / f"trainer.kubeflow.org_{name}.yaml" for name in CRD_NAMES]
        self._install_crds(files, [f"{name}.trainer.kubeflow.org" for name in CRD_NAMES], patience_s)
        self._run(binary, config, health_port, patience_s, env={**os.environ, "TMPDIR": str(temp)})
        url, ca = f"https://127.0.0.1:{webhook_port}", (certs / "ca.crt").read_bytes()
        self._register(webhook_configurations(self.namespace, url, ca))
