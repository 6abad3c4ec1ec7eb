"""A running job whose sidecars ship nothing says so: the condition NoTelemetry, a Warning Event, and
the series the chart's rule RankwatchJobNoTelemetry fires on (the rule itself: tests/deploy, promtool);
when summaries come, it takes it back.

kwok runs the workers here, so no sidecar ever ships a summary: exactly a job whose sidecars cannot
reach the collector, until the test posts one as a sidecar does (the protocol module, the job's
token). The operator is a process of the test's own, with a short silence limit."""

from __future__ import annotations

import base64
import json
import subprocess
import urllib.request

import kubernetes
import pytest

from rankwatch import protocol
from rankwatch.operator import api as names

pytestmark = pytest.mark.e2e

JOB_API = ("rankwatch.io", "v1alpha1", "trainingjobs")
SILENCE_S = 6


def test_a_running_job_without_telemetry_gets_no_telemetry_and_its_alert_series(
    processes, api, kubeconfig, kubectl, unwatched_namespace, eventually, tmp_path
):
    namespace, log, port = unwatched_namespace, tmp_path / "operator.log", processes.free_port()
    objects = kubernetes.client.CustomObjectsApi(api)
    operator = processes.operator(kubeconfig, namespace, log, port, {"RANKWATCH_NO_TELEMETRY_SECONDS": str(SILENCE_S)})
    try:
        job = {
            "apiVersion": "rankwatch.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "silent"},
            "spec": {
                "replicas": 2,
                "nprocPerNode": 1,
                "template": {"spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]}},
                "tracing": {"sensitivitySeconds": 10, "windowSeconds": 1},
            },
        }
        objects.create_namespaced_custom_object(*JOB_API[:2], namespace, JOB_API[2], job)

        def condition() -> dict | None:
            status = objects.get_namespaced_custom_object(*JOB_API[:2], namespace, JOB_API[2], "silent").get("status")
            found = [c for c in (status or {}).get("conditions", []) if c["type"] == "NoTelemetry"]
            return found[0] if found and found[0]["status"] == "True" else None

        no_telemetry = eventually(condition, 90, what="NoTelemetry=True")
        status = objects.get_namespaced_custom_object(*JOB_API[:2], namespace, JOB_API[2], "silent")["status"]
        assert status["phase"] == "Running" and status["health"] == "Unknown"
        assert no_telemetry["reason"] == "NoSummaries"
        assert "no window summary from any of the job's 2 sidecars for" in no_telemetry["message"]
        assert "since the job started running" in no_telemetry["message"]
        events = json.loads(
            kubectl(
                "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=silent", "-o", "json"
            ).stdout
        )["items"]
        warnings = [e for e in events if e["reason"] == "NoTelemetry"]
        assert len(warnings) == 1 and warnings[0]["type"] == "Warning"

        def series() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                return response.read().decode()

        expected = (
            f'rankwatch_job_condition{{condition="NoTelemetry",namespace="{namespace}",trainingjob="silent"}} 1.0'
        )
        eventually(lambda: expected in series(), 30, what="the NoTelemetry series at 1")

        # A sidecar gets through: the job says so, and the condition goes False.
        secret = kubernetes.client.CoreV1Api(api).read_namespaced_secret(names.token_secret_name("silent"), namespace)
        token = base64.b64decode(secret.data[names.TOKEN_KEY]).decode()

        def ship(window: int = 0) -> None:
            message = protocol.WindowSummary(
                schema=1, namespace=namespace, job="silent", pod="silent-worker-0", node="gpu-node-0",
                replica_index=0, expected_ranks=1, window=window, start_ns=window * 10**9,
                end_ns=(window + 1) * 10**9, dropped_summaries=0, ranks=[],
            )  # fmt: skip
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}" + protocol.SUMMARIES_PATH.format(namespace=namespace, name="silent"),
                data=protocol.encode(message),
                headers={
                    "Content-Type": protocol.CONTENT_TYPE,
                    "Content-Encoding": protocol.CONTENT_ENCODING,
                    "Authorization": protocol.bearer(token),
                },
            )
            with urllib.request.urlopen(request, timeout=5) as response:
                assert response.status < 300

        shipped = iter(range(1, 10**6))

        def resumed() -> dict | None:
            ship(next(shipped))
            status = objects.get_namespaced_custom_object(*JOB_API[:2], namespace, JOB_API[2], "silent")["status"]
            found = [c for c in status["conditions"] if c["type"] == "NoTelemetry" and c["status"] == "False"]
            return found[0] if found else None

        assert eventually(resumed, 60, interval=1, what="NoTelemetry=False")["reason"] == "SummariesArriving"
        assert eventually(lambda: expected.replace("} 1.0", "} 0.0") in series(), 30, what="the series at 0")
    finally:
        operator.terminate()
        try:
            operator.wait(15)
        except subprocess.TimeoutExpired:
            operator.kill()
        print(log.read_text()[-3000:])
