"""An edit of the alerting ConfigMap the admin brings (``alerting.existingConfigMap``) rolls the operator
pods at the next ``helm upgrade``: the chart hashes its data as the real API server holds it."""

from __future__ import annotations

import uuid
from pathlib import Path

import kubernetes
import pytest
import yaml

pytestmark = pytest.mark.e2e

CHART = Path(__file__).parents[2] / "helm" / "rankwatch"


def test_an_edit_of_the_existing_alerting_configmap_changes_the_pod_templates_checksum(helm, api, unwatched_namespace):
    core = kubernetes.client.CoreV1Api(api)
    namespace = unwatched_namespace
    config = {"receivers": [{"name": "log"}], "route": {"receiver": "log"}}
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "team-alerting"}, "data": {"alerting.yaml": yaml.safe_dump(config)}}
    )

    release = f"checksum-{uuid.uuid4().hex[:6]}"  # its cluster-scoped names clash with no other test's release

    def checksum() -> str:
        # --dry-run=server: rendered with the cluster's objects (Helm's lookup), as install and upgrade are
        rendered = helm("install", release, str(CHART), "--namespace", namespace, "--dry-run=server",
                        "--set", "alerting.enabled=true", "--set", "alerting.existingConfigMap=team-alerting",
                        ).stdout  # fmt: skip
        [deployment] = [doc for doc in yaml.safe_load_all(rendered.split("MANIFEST:", 1)[1].split("NOTES:", 1)[0])
                        if doc and doc["kind"] == "Deployment"]  # fmt: skip
        return deployment["spec"]["template"]["metadata"]["annotations"]["checksum/alerting"]

    before = checksum()
    assert checksum() == before
    config["route"]["group_wait"] = "30s"
    core.patch_namespaced_config_map("team-alerting", namespace, {"data": {"alerting.yaml": yaml.safe_dump(config)}})
    assert checksum() != before
