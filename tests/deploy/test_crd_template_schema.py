"""The CRD's spec.template schema is what crds/generate_pod_template_schema.py makes from the pinned
Kubernetes release's OpenAPI (taken from the Go module cache the cluster build fills; `go mod
download` fetches it otherwise), and the chart carries the same file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def generator():
    path = REPO / "crds" / "generate_pod_template_schema.py"
    spec = importlib.util.spec_from_file_location("generate_pod_template_schema", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def openapi(generator) -> dict:
    return json.loads(generator.openapi_file(generator.version_label()).read_text())


def test_committed_crd_is_the_generators_output(generator, openapi):
    committed = generator.CRD.read_text()
    assert generator.generate(openapi, committed) == committed, "run crds/generate_pod_template_schema.py"
    assert generator.CHART_CRD.read_text() == committed


def template_schema() -> dict:
    crd = yaml.safe_load((REPO / "crds" / "trainingjobs.rankwatch.io.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["template"]


def walk(schema, path="template"):
    yield path, schema
    if isinstance(schema, dict):
        for key, value in schema.items():
            if isinstance(value, dict | list):
                yield from walk(value, f"{path}.{key}")
    elif isinstance(schema, list):
        for index, value in enumerate(schema):
            yield from walk(value, f"{path}[{index}]")


def test_template_is_a_full_structural_pod_template():
    template = template_schema()
    pod = template["properties"]["spec"]["properties"]
    container = pod["containers"]["items"]["properties"]
    assert {"tolerations", "affinity", "volumes", "nodeSelector", "imagePullSecrets"} <= set(pod)
    assert {"resources", "env", "volumeMounts", "securityContext"} <= set(container)
    assert "ephemeralContainers" not in pod, "the API server refuses them at pod create"
    for path, node in walk(template):
        if isinstance(node, dict):
            assert "$ref" not in node and "allOf" not in node, path
            assert not node.get("x-kubernetes-preserve-unknown-fields"), f"{path} takes any field"
            assert "default" not in node, f"{path}: a default would be written into every job"
            assert not {k for k in node if k.startswith("x-kubernetes-patch")}, path
    limits = container["resources"]["properties"]["limits"]["additionalProperties"]
    assert limits["x-kubernetes-int-or-string"] and limits["anyOf"] == [{"type": "integer"}, {"type": "string"}]


def test_crd_stays_far_below_the_api_servers_size_limits():
    """etcd takes 1.5 MiB per object; `kubectl apply` (client-side) keeps the whole object in an
    annotation limited to 256 KiB."""
    crd = yaml.safe_load((REPO / "crds" / "trainingjobs.rankwatch.io.yaml").read_text())
    assert len(json.dumps(crd, separators=(",", ":"))) < 128 * 1024
