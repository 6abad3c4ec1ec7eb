"""Hardware causes, end to end: a straggler's diagnosis carries the throttle alert firing on its node in
the real Prometheus (built from its Go module, beside the local control plane), evaluated from the
chart's rule on dcgm-exporter series (served here by a loopback exporter: there is no GPU), and read
by an operator of this test's own, configured with RANKWATCH_PROMETHEUS_URL."""

from __future__ import annotations

import time

import kubernetes
import pytest
from monitoring_stack import Exporter, Prometheus, start_monitoring
from trainingjobs import STRAGGLER, create_job, diagnosed, events, report, standin_job, stored_diagnosis

pytestmark = pytest.mark.e2e

HW_THERMAL_SLOWDOWN = 0x40


def dcgm_series(nodes: list[str], throttled: int) -> str:
    """One GPU per node, its clock event reasons set to ``throttled`` (dcgm-exporter's series and labels)."""
    lines = ["# TYPE DCGM_FI_DEV_CLOCKS_EVENT_REASONS gauge"]
    for index, node in enumerate(nodes):
        labels = f'gpu="5",UUID="GPU-5b2e-{index}",Hostname="{node}",modelName="NVIDIA H100 80GB HBM3"'
        lines.append(f"DCGM_FI_DEV_CLOCKS_EVENT_REASONS{{{labels}}} {throttled}")
    return "\n".join(lines) + "\n"


def test_a_stragglers_diagnosis_carries_the_throttle_alert_firing_on_its_node(
    api, kubeconfig, unwatched_namespace, processes, eventually, tmp_path
):
    monitoring = start_monitoring()
    prometheus = Prometheus(monitoring.prometheus_url)

    # Every node's GPU 5 is throttled (HW thermal slowdown), so the diagnosis must pick its own node's alert.
    nodes = sorted(node.metadata.name for node in kubernetes.client.CoreV1Api(api).list_node().items)
    dcgm = Exporter()
    dcgm.text = dcgm_series(nodes, HW_THERMAL_SLOWDOWN)
    monitoring.scrape("dcgm-exporter", [dcgm.address])
    namespace, port = unwatched_namespace, processes.free_port()
    operator = processes.operator(
        kubeconfig, namespace, tmp_path / "operator.log", port, {"RANKWATCH_PROMETHEUS_URL": monitoring.prometheus_url}
    )
    runner = processes.pod_runner(kubeconfig, f"http://127.0.0.1:{port}", namespace, tmp_path / "pods")
    try:
        throttled = {
            alert["labels"]["node"]
            for alert in eventually(
                lambda: (
                    len(prometheus.firing("GPUClocksThrottled")) >= len(nodes)
                    and prometheus.firing("GPUClocksThrottled")
                ),
                60,
                what="GPUClocksThrottled firing on every node",
            )
        }
        assert throttled >= set(nodes)

        started = time.monotonic()
        faults = STRAGGLER
        create_job(api, namespace, standin_job("throttled", faults))
        job = eventually(lambda: diagnosed(api, namespace, "throttled", "Degraded"), 120, interval=1, what="Degraded")
        print(f"diagnosed {time.monotonic() - started:.1f} s after the job was created")
        diagnosis = stored_diagnosis(job)
        (node,) = diagnosis["nodes"]
        (line,) = diagnosis["nodeAlerts"]  # its node's alert, none of the other nodes'
        assert line.startswith(f"GPUClocksThrottled (P2) on {node} since "), line
        assert line.endswith(f": GPU 5 on {node} slows its clocks: hw_thermal_slowdown"), line
        assert not [p for p in diagnosis.get("problems") or [] if "Prometheus" in p], diagnosis["problems"]
        finding = report(api, namespace, job)["findings"][0]
        assert [alert["name"] for alert in finding["evidence"]["node_alerts"]] == ["GPUClocksThrottled"]
        warning = eventually(
            lambda: [e.message for e in events(api, namespace, "throttled") if e.reason == diagnosis["kind"]],
            20,
            what="the diagnosis Event",
        )[0]
        assert f"firing on its node: {line}" in warning, warning
    finally:
        processes.stop(runner)
        processes.stop(operator)
        monitoring.scrape("dcgm-exporter", [])
        dcgm.shutdown()
        print((tmp_path / "operator.log").read_text()[-3000:])
