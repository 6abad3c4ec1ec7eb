"""The typed spec agrees with the CRD the API server enforces."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from rankwatch.model.diagnosis_status import STATUS_KEY
from rankwatch.model.finding import STUCK_IN_COLLECTIVE, Cause, FindingKind
from rankwatch.operator.spec import (
    Alerting,
    AlertLevels,
    InvalidSpec,
    Parallelism,
    Recovery,
    Remediation,
    RestartOn,
    S3Archive,
    Sidecar,
    Tracing,
    TrainingJobSpec,
)

CRD = yaml.safe_load((Path(__file__).parents[2] / "crds" / "trainingjobs.rankwatch.io.yaml").read_text())
SPEC_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]


@pytest.mark.parametrize(
    ("cls", "schema"),
    [
        (TrainingJobSpec, SPEC_SCHEMA),
        (Parallelism, SPEC_SCHEMA["parallelism"]["properties"]),
        (Tracing, SPEC_SCHEMA["tracing"]["properties"]),
        (Sidecar, SPEC_SCHEMA["sidecar"]["properties"]),
        (Remediation, SPEC_SCHEMA["remediation"]["properties"]),
        (Alerting, SPEC_SCHEMA["alerting"]["properties"]),
        (AlertLevels, SPEC_SCHEMA["alerting"]["properties"]["levels"]["properties"]),
        (Recovery, SPEC_SCHEMA["recovery"]["properties"]),
        (RestartOn, SPEC_SCHEMA["recovery"]["properties"]["restartOn"]["properties"]),
        (S3Archive, SPEC_SCHEMA["tracing"]["properties"]["archive"]["properties"]["s3"]["properties"]),
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


def test_every_level_field_is_in_the_crd_and_every_finding_kind_has_a_level():
    crd_levels = SPEC_SCHEMA["alerting"]["properties"]["levels"]["properties"]
    assert {kind.level_key for kind in FindingKind} == set(crd_levels) == {f.name for f in fields(AlertLevels)}
    assert [AlertLevels().for_finding(kind) for kind in ("hang", "straggler", "slow_link", "fail_slow")] == [
        "P0",
        "P1",
        "P1",
        "P2",
    ]


def test_from_manifest_reads_alerting_levels_and_refuses_unknown_kinds():
    spec = TrainingJobSpec.from_manifest({"template": {}, "alerting": {"route": "llm", "levels": {"straggler": "P0"}}})
    assert spec.alerting == Alerting(route="llm", levels=AlertLevels(straggler="P0"))
    with pytest.raises(InvalidSpec, match=r"spec\.alerting.*stall"):
        TrainingJobSpec.from_manifest({"template": {}, "alerting": {"levels": {"stall": "P0"}}})


def test_the_status_speaks_the_finding_kinds_reasons():
    status = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    reasons = status[STATUS_KEY]["properties"]["kind"]["enum"]
    assert set(reasons) == {kind.reason for kind in FindingKind} | {STUCK_IN_COLLECTIVE}
    assert all(FindingKind.from_reason(reason) for reason in reasons)


def test_the_status_admits_every_cause():
    # a cause the CRD refuses fails the whole status write: the diagnosis is never seen (a mismatch's software)
    status = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert set(status[STATUS_KEY]["properties"]["cause"]["enum"]) == {cause.value for cause in Cause}


def test_from_manifest_reads_recovery_and_the_archive_without_the_secret_values():
    spec = TrainingJobSpec.from_manifest(
        {
            "template": {},
            "recovery": {"maxRestarts": 1, "restartOn": {"slowdownAbove": 0.5}},
            "tracing": {
                "archive": {"s3": {"bucket": "traces", "endpoint": "http://s3:9000", "secretRef": {"name": "s3"}}}
            },
        }
    )
    assert spec.recovery == Recovery(maxRestarts=1, restartOn=RestartOn(slowdownAbove=0.5))
    assert spec.recovery.restarts and not Recovery(policy="None").restarts
    assert spec.tracing.archive.s3 == S3Archive(bucket="traces", secretRef="s3", endpoint="http://s3:9000")
    with pytest.raises(InvalidSpec, match=r"spec\.recovery.*restartAt"):
        TrainingJobSpec.from_manifest({"template": {}, "recovery": {"restartAt": 3}})
    with pytest.raises(InvalidSpec, match=r"secretRef\.name is required"):
        TrainingJobSpec.from_manifest({"template": {}, "tracing": {"archive": {"s3": {"bucket": "traces"}}}})
