"""Every Kubernetes API call of the operator ends within its configured timeout: a server that takes
the request and never answers (a partition that holds the connection open) fails the call instead of
hanging the diagnosis or cordon that made it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import kubernetes
import pytest
import urllib3

from rankwatch.kube import api_client


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A loopback TCP server that accepts connections, reads what comes, and never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            held.append(connection)

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
    for connection in held:
        connection.close()


@pytest.mark.parametrize("call", ["patch_node", "create_namespaced_event"])
def test_a_call_to_a_server_that_never_answers_fails_within_the_timeout(loopback_kubeconfig, silent_server, call):
    kube = api_client(loopback_kubeconfig(silent_server), request_timeout=0.5)
    core = kubernetes.client.CoreV1Api(kube)
    started = time.monotonic()
    with pytest.raises(urllib3.exceptions.HTTPError):  # a read timeout: not retried for a write
        if call == "patch_node":
            core.patch_node("node-1", {"spec": {"unschedulable": True}})
        else:
            core.create_namespaced_event("default", {"metadata": {"name": "e"}, "involvedObject": {}})
    assert time.monotonic() - started < 5


def test_a_call_may_still_name_its_own_timeout(loopback_kubeconfig, silent_server):
    kube = api_client(loopback_kubeconfig(silent_server), request_timeout=60)
    started = time.monotonic()
    with pytest.raises(urllib3.exceptions.HTTPError):
        kubernetes.client.CoreV1Api(kube).patch_node("node-1", {}, _request_timeout=0.3)
    assert time.monotonic() - started < 5
