"""The typed spec agrees with the CRD the API server enforces."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from rankwatch.operator.spec import InvalidSpec, Parallelism, Remediation, Tracing, TrainingJobSpec

CRD = yaml.safe_load((Path(__file__).parents[2] / "crds" / "trainingjobs.rankwatch.io.yaml").read_text())
SPEC_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]


@pytest.mark.parametrize(
    ("cls", "schema"),
    [
        (TrainingJobSpec, SPEC_SCHEMA),
        (Parallelism, SPEC_SCHEMA["parallelism"]["properties"]),
        (Tracing, SPEC_SCHEMA["tracing"]["properties"]),
        (Remediation, SPEC_SCHEMA["remediation"]["properties"]),
    ],
)
def test_dataclass_defaults_equal_crd_defaults(cls, schema):
    for field in fields(cls):
        assert field.name in schema, f"{cls.__name__}.{field.name} is not in the CRD"
        crd_default = schema[field.name].get("default")
        if crd_default is not None and not isinstance(crd_default, dict):
            assert field.default == crd_default, f"{cls.__name__}.{field.name}"


def test_from_manifest_derives_world_and_data_parallel_size():
    spec = TrainingJobSpec.from_manifest(
        {"template": {"spec": {}}, "replicas": 4, "nprocPerNode": 8, "parallelism": {"tensor": 8, "pipeline": 2}}
    )
    assert (spec.world_size, spec.data_parallel) == (32, 2)


def test_from_manifest_names_missing_and_unknown_fields():
    with pytest.raises(InvalidSpec, match=r"spec.template is required"):
        TrainingJobSpec.from_manifest({"replicas": 1})
    with pytest.raises(InvalidSpec, match="sensitivity"):
        TrainingJobSpec.from_manifest({"template": {}, "tracing": {"sensitivity": 3}})
