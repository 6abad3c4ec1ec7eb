"""The one place rankwatch builds a Kubernetes API client (operator, `rankwatch uncordon`, `rankwatch alerts`)."""

from __future__ import annotations

import os
from typing import Any

import kubernetes

DEFAULT_REQUEST_TIMEOUT_S = 30.0
"""Longest an API call may take before it fails (and its caller retries): the kubernetes library
sets no timeout, so a call on a connection a partition left open without carrying bytes would wait
forever, and with it the diagnosis or cordon that made it."""


class TimedApiClient(kubernetes.client.ApiClient):
    """An ApiClient whose every request that names no ``_request_timeout`` of its own ends within
    ``request_timeout`` seconds (``urllib3`` raises a timeout error the callers treat as any failure)."""

    def __init__(self, configuration: kubernetes.client.Configuration, request_timeout: float) -> None:
        super().__init__(configuration)
        self.request_timeout = request_timeout

    def request(self, method: str, url: str, *args: Any, _request_timeout: Any = None, **kwargs: Any) -> Any:
        timeout = self.request_timeout if _request_timeout is None else _request_timeout
        return super().request(method, url, *args, _request_timeout=timeout, **kwargs)


def api_client(
    kubeconfig: str | None = None, request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S
) -> kubernetes.client.ApiClient:
    """In a pod, its ServiceAccount; elsewhere ``kubeconfig``, else ``$KUBECONFIG`` as it is now (the
    library reads it at import time), else ``~/.kube/config``, as kubectl would. Every call through it
    ends within ``request_timeout`` seconds. Its configuration also becomes the library's default, so
    that code building API objects without a client (``CoreV1Api()``) talks to the same cluster as
    the same identity."""
    configuration = kubernetes.client.Configuration()
    if kubeconfig is None:
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(
                config_file=os.environ.get("KUBECONFIG") or None, client_configuration=configuration
            )
    else:
        kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    kubernetes.client.Configuration.set_default(configuration)
    return TimedApiClient(configuration, request_timeout)
