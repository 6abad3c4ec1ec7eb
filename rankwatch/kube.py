"""The one place rankwatch builds a Kubernetes API client (operator, `rankwatch uncordon`, `rankwatch alerts`)."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import kubernetes
import urllib3
import yaml
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_REQUEST_TIMEOUT_S = 30.0
"""Longest an API call may take before it fails (and its caller retries): the kubernetes library
sets no timeout, so a call on a connection a partition left open without carrying bytes would wait
forever, and with it the diagnosis or cordon that made it."""


TRANSIENT_ATTEMPTS = 3
"""Tries of a call that failed in a way the next try may not (see :func:`is_transient`)."""
FIRST_BACKOFF_S = 0.25
"""Wait before the second try; doubled before each next one, all waits together at most half the
client's request timeout (so the tries stay within a few timeouts' budget)."""


NAMES_ONLY = "application/json;as=Table;g=meta.k8s.io;v=v1,application/json"
"""Accept header (with ``includeObject=None``) of a list that wants names only: the API server answers a
Table of kubectl's columns without the objects (~100 bytes a pod; metadata alone is ~7 KiB, most of it
managedFields). A server without Tables answers the plain list (the ``application/json`` fallback)."""


CONNECTIONS = 32
"""Connections kept per API server (the library keeps 5 per CPU): kopf's handler threads, the calls run
off the event loop and several jobs' pod creates at once (``POD_CREATES_IN_FLIGHT`` each) share them;
a request finding the pool full opens a connection (a TLS handshake) and throws it away after."""


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
            _load_kubeconfig(os.environ.get("KUBECONFIG") or None, "$KUBECONFIG", configuration)
    else:
        _load_kubeconfig(kubeconfig, "--kubeconfig", configuration)
    configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize, CONNECTIONS)
    kubernetes.client.Configuration.set_default(configuration)
    return TimedApiClient(configuration, request_timeout)


class KubeconfigError(kubernetes.config.ConfigException):
    """No cluster to talk to: the message names the file and what to do (one line for a CLI)."""


def _load_kubeconfig(path: str | None, given_as: str, configuration: kubernetes.client.Configuration) -> None:
    """Load a kubeconfig (``path``: a file, or None for ``~/.kube/config``), with an error that says which
    file and how to give another, instead of the library's traceback."""
    shown = f"{given_as} {path}" if path else "~/.kube/config ($KUBECONFIG is unset)"
    first = (path or "").split(os.pathsep)[0] or os.path.expanduser("~/.kube/config")
    if not os.path.isfile(first):
        raise KubeconfigError(
            f"no kubeconfig: {shown}: no such file, and this is not a pod with a ServiceAccount; "
            "give --kubeconfig FILE or set KUBECONFIG"
        )
    try:
        kubernetes.config.load_kube_config(config_file=path, client_configuration=configuration)
    except (kubernetes.config.ConfigException, OSError, ValueError, TypeError, KeyError, yaml.YAMLError) as error:
        reason = " ".join(str(error).split())  # YAML errors span lines
        raise KubeconfigError(f"kubeconfig {first} cannot be used: {reason}") from None


def connection_problem(error: BaseException) -> str | None:
    """One line for a command that could not reach its cluster (no kubeconfig, the API server away), or
    None for an error of another kind."""
    if isinstance(error, KubeconfigError):
        return str(error)
    if isinstance(error, urllib3.exceptions.MaxRetryError | urllib3.exceptions.NewConnectionError):
        host = kubernetes.client.Configuration.get_default_copy().host
        reason = str(getattr(error, "reason", None) or error)
        reason = reason.rsplit("Failed to establish a new connection: ", 1)[-1].rstrip("\")'")
        return f"cannot reach the Kubernetes API server at {host}: {reason}"
    return None


def is_transient(error: BaseException) -> bool:
    """A failure the same request may not meet again: the API server's 5xx or 429, a timeout, a
    connection refused or dropped. A 4xx (forbidden, invalid, conflict, gone) will not change by
    trying again; the caller decides what it means."""
    if isinstance(error, ApiException):
        return not error.status or error.status == 429 or error.status >= 500  # 0: TLS broken off
    return isinstance(error, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError)


def with_retries(
    call: Callable[[], T], api: kubernetes.client.ApiClient, *, what: str, sleep: Callable[[float], None] = time.sleep
) -> T:
    """``call()``, tried up to :data:`TRANSIENT_ATTEMPTS` times while it fails transiently, with doubling
    waits in between that add up to at most half of ``api``'s request timeout; the last failure, or
    the first that is not transient, is raised. Only for calls that are safe to repeat (a write must
    be conditional, e.g. carry a resourceVersion, so a repeat of one that did land fails with 409)."""
    budget = getattr(api, "request_timeout", DEFAULT_REQUEST_TIMEOUT_S) / 2
    delay = FIRST_BACKOFF_S
    for attempt in range(1, TRANSIENT_ATTEMPTS + 1):
        try:
            return call()
        except Exception as error:
            if attempt == TRANSIENT_ATTEMPTS or not is_transient(error):
                raise
            delay = min(delay, budget)
            budget -= delay
            reason = f"HTTP {error.status} {error.reason}" if isinstance(error, ApiException) else repr(error)
            log.warning("%s failed (%s); try %d of %d in %.2f s", what, reason, attempt + 1, TRANSIENT_ATTEMPTS, delay)
            sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


def pod_names(api: kubernetes.client.ApiClient, namespace: str, label_selector: str) -> set[str]:
    """Names of the pods in ``namespace`` that match ``label_selector`` (those being deleted too), without
    their bodies. A full list of a 160-pod job is ~30 MiB of V1Pod models and parsed JSON in the client:
    made on every status sync of a Pending job, it grew the operator's resident memory by ~0.25 MiB
    per pod (the heap does not shrink back)."""
    response = api.call_api(
        f"/api/v1/namespaces/{namespace}/pods",
        "GET",
        query_params=[("labelSelector", label_selector), ("includeObject", "None")],
        header_params={"Accept": NAMES_ONLY},
        auth_settings=["BearerToken"],
        _preload_content=False,
        _return_http_data_only=True,
    )
    try:
        listed = json.loads(response.data)
    finally:
        response.release_conn()
    if listed.get("kind") != "Table":
        return {item["metadata"]["name"] for item in listed.get("items") or []}
    column = [definition["name"] for definition in listed["columnDefinitions"]].index("Name")
    return {row["cells"][column] for row in listed.get("rows") or []}


def drain(response: Any) -> None:
    """Read and let go of a ``_preload_content=False`` answer nobody needs (a create's echo of the object),
    so no model is built from it and its connection goes back to the pool."""
    response.read()
    response.release_conn()
