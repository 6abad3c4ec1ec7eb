"""A node write that meets a passing failure of the API server (5xx, a dropped connection) is tried
again a few times within the API timeout budget; one the server refuses (4xx) is not."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from rankwatch.kube import TRANSIENT_ATTEMPTS, api_client, with_retries
from rankwatch.operator.remediation.node_actions import patch_node


class ScriptedApiServer(http.server.ThreadingHTTPServer):
    """Answers each PATCH with the next status of ``script`` (the last one repeats), a Node for 200."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script = script
        self.patches: list[float] = []


class _Handler(http.server.BaseHTTPRequestHandler):
    server: ScriptedApiServer

    def do_PATCH(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.patches.append(time.monotonic())
        script = self.server.script
        status = script[min(len(self.server.patches), len(script)) - 1]
        body = {"kind": "Node", "apiVersion": "v1", "metadata": {"name": "node-1"}} if status == 200 else {
            "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": status}  # fmt: skip
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def serve(loopback_kubeconfig) -> Iterator:
    servers: list[ScriptedApiServer] = []

    def start(*script: int, timeout: float = 4.0):
        server = ScriptedApiServer(list(script))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server, api_client(loopback_kubeconfig(server.server_address[1]), request_timeout=timeout)

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


PATCH = {"metadata": {"resourceVersion": "1"}, "spec": {"unschedulable": True}}


def test_a_node_patch_answered_503_once_is_tried_again_and_lands(serve):
    server, kube = serve(503, 200)
    assert patch_node(kube, "node-1", PATCH) is True
    assert len(server.patches) == 2


def test_a_node_patch_refused_with_a_4xx_is_not_tried_again(serve):
    server, kube = serve(403)
    with pytest.raises(ApiException) as refused:
        patch_node(kube, "node-1", PATCH)
    assert refused.value.status == 403 and len(server.patches) == 1


def test_a_conflict_is_not_retried_but_answered_as_a_changed_node(serve):
    server, kube = serve(409)
    assert patch_node(kube, "node-1", PATCH) is False
    assert len(server.patches) == 1


def test_a_server_failing_every_try_fails_the_patch_after_bounded_tries_within_the_timeout_budget(serve):
    server, kube = serve(500, timeout=1.0)
    with pytest.raises(ApiException) as failed:
        patch_node(kube, "node-1", PATCH)
    assert failed.value.status == 500 and len(server.patches) == TRANSIENT_ATTEMPTS
    waits = [b - a for a, b in zip(server.patches, server.patches[1:], strict=False)]
    assert all(wait > 0.1 for wait in waits), waits  # backed off
    slept: list[float] = []  # the waits it plans, not the time a loaded machine takes
    with pytest.raises(ApiException):
        with_retries(lambda: patch_node_once(kube), kube, what="patch", sleep=slept.append)
    assert len(slept) == TRANSIENT_ATTEMPTS - 1 and sum(slept) <= 0.5, "the waits fit in half the API timeout"


def patch_node_once(kube) -> None:
    kubernetes.client.CoreV1Api(kube).patch_node("node-1", PATCH)
