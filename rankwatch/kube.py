"""The one place rankwatch builds a Kubernetes API client (operator, `rankwatch uncordon`, `rankwatch alerts`)."""

from __future__ import annotations

import os

import kubernetes


def api_client(kubeconfig: str | None = None) -> kubernetes.client.ApiClient:
    """In a pod, its ServiceAccount; elsewhere ``kubeconfig``, else ``$KUBECONFIG`` as it is now (the
    library reads it at import time), else ``~/.kube/config``, as kubectl would."""
    if kubeconfig is None:
        configuration = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
            return kubernetes.client.ApiClient(configuration)
        except kubernetes.config.ConfigException:
            kubeconfig = os.environ.get("KUBECONFIG") or None
    return kubernetes.config.new_client_from_config(config_file=kubeconfig)
