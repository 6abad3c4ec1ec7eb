"""The real JobSet controller (sigs.k8s.io/jobset, built from its Go module and cached like the cluster's
binaries) run against the local cluster, for the tests of JobSet groups and the demo.

Out of cluster, as the tests run rankwatch's own operator: its CRD from the module's own manifests, its
admission webhooks (JobSet defaulting and validation, its pod webhooks) served on loopback with a
certificate made here (the local API server runs on this host and calls https://127.0.0.1), registered
for one namespace only (and, for pods, only those a JobSet made), so a controller that is stopped keeps
no other test's pod from being admitted. ``stop`` removes the registrations. Also where Volcano's Job
CRD comes from (its module's manifests; its controller is not run here).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

from rankwatch.cluster import binaries, pki, ports
from rankwatch.cluster.loopback_controller import LoopbackController, serve_on_loopback
from rankwatch.cluster.versions import JOBSET, VOLCANO_MODULE_VERSION

CRD = "config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml"
WEBHOOKS = "config/components/webhook/manifests.yaml"
POD_SELECTOR = {"matchExpressions": [{"key": "jobset.sigs.k8s.io/jobset-name", "operator": "Exists"}]}


def module_source(module: str, version: str) -> Path:
    """A Go module's source (its manifests) in the Go module cache, downloaded if absent."""
    result = subprocess.run(
        ["go", "mod", "download", "-json", f"{module}@{version}"],
        cwd=JOBSET.module_dir,
        env={**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=readonly"},
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(json.loads(result.stdout)["Dir"])


def module_dir() -> Path:
    return module_source("sigs.k8s.io/jobset", JOBSET.version)


VOLCANO_JOB_CRD = "config/crd/volcano/bases/batch.volcano.sh_jobs.yaml"


def volcano_job_crd() -> Path:
    """Volcano's Job CRD as its release ships it (``cluster.versions.VOLCANO_MODULE_VERSION``)."""
    return module_source("volcano.sh/volcano", VOLCANO_MODULE_VERSION) / VOLCANO_JOB_CRD


def webhook_configurations(namespace: str, url: str, ca_bundle: bytes) -> list[dict[str, Any]]:
    """JobSet's webhook configurations aimed at ``url`` (its paths kept), for ``namespace`` only."""
    documents = [doc for doc in yaml.safe_load_all((module_dir() / WEBHOOKS).read_text()) if doc]
    configurations = []
    for document in documents:
        configuration = copy.deepcopy(document)
        configuration["metadata"] = {"name": f"jobset-{namespace}-{document['kind'].lower()}"}
        for webhook in configuration["webhooks"]:
            path = webhook["clientConfig"]["service"]["path"]
            serve_on_loopback(webhook, f"{url}{path}", ca_bundle, namespace)
            if any("pods" in rule.get("resources", []) for rule in webhook.get("rules", [])):
                webhook["objectSelector"] = POD_SELECTOR
        configurations.append(configuration)
    return configurations


class JobSetController(LoopbackController):
    """``start`` installs the CRD, serves and registers the webhooks, runs the controller until ``stop``."""

    title = "JobSet controller"

    def start(self, patience_s: float = 300) -> None:
        binary = binaries.ensure_component(JOBSET) / "jobset-controller"
        self.work_dir.mkdir(parents=True, exist_ok=True)
        certs = self.work_dir / "certs"
        pki.issue_serving(certs, ["127.0.0.1"])
        webhook_port, health_port = ports.free_ports(2)
        config = {
            "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(certs)},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        }
        self._install_crds([module_dir() / CRD], ["jobsets.jobset.x-k8s.io"], patience_s)
        self._run(binary, config, health_port, patience_s)
        url, ca = f"https://127.0.0.1:{webhook_port}", (certs / "ca.crt").read_bytes()
        self._register(webhook_configurations(self.namespace, url, ca))
