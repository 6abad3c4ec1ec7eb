"""The one place rankwatch builds a Kubernetes API client (operator, `rankwatch uncordon`, `rankwatch alerts`)."""

from __future__ import annotations

import os

import kubernetes


def api_client(kubeconfig: str | None = None) -> kubernetes.client.ApiClient:
    """In a pod, its ServiceAccount; elsewhere ``kubeconfig``, else ``$KUBECONFIG`` as it is now (the
    library reads it at import time), else ``~/.kube/config``, as kubectl would. Its configuration
    also becomes the library's default, so that code building API objects without a client
    (``CoreV1Api()``) talks to the same cluster as the same identity."""
    if kubeconfig is None:
        configuration = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
            client = kubernetes.client.ApiClient(configuration)
        except kubernetes.config.ConfigException:
            client = kubernetes.config.new_client_from_config(config_file=os.environ.get("KUBECONFIG") or None)
    else:
        client = kubernetes.config.new_client_from_config(config_file=kubeconfig)
    kubernetes.client.Configuration.set_default(client.configuration)
    return client
