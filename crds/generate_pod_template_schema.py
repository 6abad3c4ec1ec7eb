"""Write the schema of TrainingJob ``spec.template`` into the CRD, from Kubernetes' own OpenAPI.

The worker pod template is a real ``PodTemplateSpec`` of the pinned Kubernetes release
(``rankwatch.cluster.versions.KUBERNETES_VERSION``, the one the local cluster is built from), so the
API server refuses a misspelt field (``resource:``, ``toleration:``) at apply, as it would in a
Deployment, instead of the operator making a pod without it. The OpenAPI v3 document
``api/openapi-spec/v3/api__v1_openapi.json`` of module ``k8s.io/kubernetes`` is pruned to what a CRD
structural schema allows:

- every ``$ref`` inlined (no recursion under PodSpec); ``Quantity`` and ``IntOrString`` become
  ``x-kubernetes-int-or-string`` with ``anyOf``, as controller-gen writes them;
- no descriptions and no defaults (the API server defaults the Pod when the operator creates it;
  defaults here would be written into every job); ``format`` only where the CRD validator knows it;
- ``x-kubernetes-list-type`` / ``-list-map-keys`` / ``-map-type`` kept where a CRD may have them
  (a map list only when its keys are required), patch strategies and unions dropped;
- ``ephemeralContainers`` left out (the API server refuses them at pod create), so an unknown field;
- every ``ObjectMeta`` (the pod's, an ephemeral volume's claim template): labels and annotations
  (the operator copies these onto the worker pods) and the few fields a copied template carries.

rankwatch's own rules sit on top (``with_rankwatch_rules``); the rule that a pod's GPUs cover
nprocPerNode is on ``spec`` (it reads both), written in the CRD by hand. Run from the repository root:

    .venv/bin/python crds/generate_pod_template_schema.py            # rewrite the CRD and the chart's copy
    .venv/bin/python crds/generate_pod_template_schema.py --check     # exit 1 if they differ

The OpenAPI file comes from the Go module cache (``go mod download``, the module the cluster build
already fetched) unless ``--openapi FILE`` names one.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "crds" / "trainingjobs.rankwatch.io.yaml"
CHART_CRD = REPO / "helm" / "rankwatch" / "crds" / CRD.name
"""The chart's copy: the same file (tests/deploy/test_chart.py holds them equal)."""
TEMPLATE_KEY = "                template:"
"""The line that opens spec.template's schema in the CRD (spec.versions[0].schema...spec.properties)."""
OPENAPI_PATH = "api/openapi-spec/v3/api__v1_openapi.json"
REF_PREFIX = "#/components/schemas/"

QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
QUANTITY_MAX_LENGTH = 64
"""Bounds the CEL cost of reading a quantity (the GPU rule); 64 characters hold any real one."""
MAX_CONTAINERS = 64
"""Bounds the CEL cost of the GPU rule, which visits every container; Kubernetes sets no limit."""
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
TEMPLATE_METADATA = {
    "type": "object",
    "properties": {
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
        # Set by Kubernetes for the object made from the template; accepted (templates copied from
        # `kubectl create --dry-run -o yaml` carry `creationTimestamp: null`) and not used.
        "name": {"type": "string"},
        "generateName": {"type": "string"},
        "namespace": {"type": "string"},
        "creationTimestamp": {"type": "string", "format": "date-time", "nullable": True},
    },
}
"""An ObjectMeta inside a template (the pod's, an ephemeral volume's claim): what a template may set."""
KNOWN_FORMATS = {"int32", "int64", "float", "double", "byte", "date-time", "date"}
KEPT_MARKERS = ("x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-map-type")
POD_SPEC = "io.k8s.api.core.v1.PodSpec"
LEFT_OUT = {POD_SPEC: {"ephemeralContainers"}}


def openapi_file(version: str) -> Path:
    """The module's OpenAPI document, from the Go module cache (downloaded if the cache lacks it)."""
    env = {**os.environ, "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"}
    result = subprocess.run(
        ["go", "mod", "download", "-json", f"k8s.io/kubernetes@{version}"],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        cwd="/",
    )
    if result.returncode != 0:
        raise SystemExit(f"go mod download k8s.io/kubernetes@{version} failed:\n{result.stdout}{result.stderr}")
    return Path(json.loads(result.stdout)["Dir"]) / OPENAPI_PATH


class Pruner:
    def __init__(self, schemas: dict[str, Any]) -> None:
        self.schemas = schemas

    def named(self, name: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
        if name == QUANTITY:
            return {"anyOf": [{"type": "integer"}, {"type": "string"}], "pattern": QUANTITY_PATTERN,
                    "maxLength": QUANTITY_MAX_LENGTH, "x-kubernetes-int-or-string": True}  # fmt: skip
        if name == INT_OR_STRING:
            return {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}
        if name == OBJECT_META:
            return copy.deepcopy(TEMPLATE_METADATA)
        if name in seen:
            raise ValueError(f"recursive schema {' -> '.join((*seen, name))}: cannot inline it into a CRD")
        return self.prune(self.schemas[name], (*seen, name), LEFT_OUT.get(name, set()))

    def prune(self, schema: dict[str, Any], seen: tuple[str, ...], left_out: set[str] = frozenset()) -> dict[str, Any]:
        if "$ref" in schema:
            return self.named(schema["$ref"].removeprefix(REF_PREFIX), seen)
        if "allOf" in schema:
            (only,) = schema["allOf"]  # the v3 document wraps a $ref with its own description/default
            merged = self.prune(only, seen)
            for marker in KEPT_MARKERS:
                if marker in schema:
                    merged[marker] = schema[marker]
            return merged
        out: dict[str, Any] = {}
        if "type" in schema:
            out["type"] = schema["type"]
        if schema.get("format") in KNOWN_FORMATS:
            out["format"] = schema["format"]
        if "enum" in schema:
            out["enum"] = schema["enum"]
        if "properties" in schema:
            out["properties"] = {
                key: self.prune(value, seen)
                for key, value in sorted(schema["properties"].items())
                if key not in left_out
            }
        if "required" in schema:
            out["required"] = [key for key in schema["required"] if key not in left_out]
        if "items" in schema:
            out["items"] = self.prune(schema["items"], seen)
        if isinstance(schema.get("additionalProperties"), dict):
            out["additionalProperties"] = self.prune(schema["additionalProperties"], seen)
        for marker in KEPT_MARKERS:
            if marker in schema:
                out[marker] = schema[marker]
        _keep_map_list_only_with_required_keys(out)
        if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
            out["x-kubernetes-preserve-unknown-fields"] = True  # free-form (none under PodSpec today)
        return out


def _keep_map_list_only_with_required_keys(schema: dict[str, Any]) -> None:
    """A CRD's map list needs every key required (defaults are gone); else the list stays atomic."""
    if schema.get("x-kubernetes-list-type") != "map":
        return
    required = set(schema.get("items", {}).get("required", []))
    if not set(schema.get("x-kubernetes-list-map-keys", [])) <= required:
        schema["x-kubernetes-list-type"] = "atomic"
        schema.pop("x-kubernetes-list-map-keys", None)


def template_schema(openapi: dict[str, Any]) -> dict[str, Any]:
    schemas = openapi["components"]["schemas"]
    pruner = Pruner(schemas)
    return with_rankwatch_rules(
        {"type": "object", "properties": {"metadata": pruner.named(OBJECT_META), "spec": pruner.named(POD_SPEC)}}
    )


def with_rankwatch_rules(template: dict[str, Any]) -> dict[str, Any]:
    """What rankwatch asks beyond a valid pod template (the API server says these too, at apply)."""
    template = copy.deepcopy(template)
    template = {
        "description": (
            f"Pod template of a worker (a PodTemplateSpec as in a Deployment, checked against Kubernetes "
            f"{version_label()}'s schema). rankwatch adds the rest."
        ),
        **template,
        "required": ["spec"],
        "x-kubernetes-validations": [
            {"rule": "self == oldSelf", "message": "template is immutable; running workers are not restarted in place"}
        ],
    }
    spec = template["properties"]["spec"]
    spec["required"] = sorted(set(spec.get("required", [])) | {"containers"})
    spec["properties"]["containers"].update(minItems=1, maxItems=MAX_CONTAINERS)
    container = spec["properties"]["containers"]["items"]
    container["required"] = sorted(set(container.get("required", [])) | {"name", "image"})
    container["properties"]["name"].update(minLength=1, maxLength=63)
    container["properties"]["image"]["minLength"] = 1
    spec["properties"]["restartPolicy"]["enum"] = ["Never", "OnFailure"]
    return template


def version_label() -> str:
    sys.path.insert(0, str(REPO))
    from rankwatch.cluster.versions import KUBERNETES_VERSION

    return KUBERNETES_VERSION


def render_block(template: dict[str, Any]) -> str:
    indent = " " * (len(TEMPLATE_KEY) - len(TEMPLATE_KEY.lstrip()))
    text = yaml.safe_dump({"template": template}, sort_keys=False, default_flow_style=None, width=120)
    return "".join(f"{indent}{line}\n" if line else "\n" for line in text.splitlines())


def with_template(crd_text: str, block: str) -> str:
    """``crd_text`` with spec.template's schema replaced by ``block`` (comments elsewhere kept)."""
    lines = crd_text.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.rstrip("\n") == TEMPLATE_KEY)
    depth = len(TEMPLATE_KEY) - len(TEMPLATE_KEY.lstrip())
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > depth):
        end += 1
    return "".join(lines[:start]) + block + "".join(lines[end:])


def generate(openapi: dict[str, Any], crd_text: str) -> str:
    return with_template(crd_text, render_block(template_schema(openapi)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--openapi", type=Path, help=f"the OpenAPI v3 document ({OPENAPI_PATH} of k8s.io/kubernetes)")
    parser.add_argument("--check", action="store_true", help="only compare: exit 1 when a CRD file differs")
    args = parser.parse_args(argv)
    openapi = json.loads((args.openapi or openapi_file(version_label())).read_text())
    current = CRD.read_text()
    wanted = generate(openapi, current)
    stale = [path for path, text in ((CRD, current), (CHART_CRD, CHART_CRD.read_text())) if text != wanted]
    if args.check:
        if stale:
            print(f"out of date: {', '.join(str(p.relative_to(REPO)) for p in stale)}; run {sys.argv[0]}")
        return 1 if stale else 0
    for path in (CRD, CHART_CRD):
        path.write_text(wanted)
        print(f"{path.relative_to(REPO)}: {len(wanted.encode()):,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
