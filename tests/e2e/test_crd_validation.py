"""The API server itself refuses a bad TrainingJob, with a message naming the field."""

from __future__ import annotations

import copy

import pytest
import yaml

pytestmark = pytest.mark.e2e

VALID = {
    "apiVersion": "rankwatch.io/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "check"},
    "spec": {
        "replicas": 15,
        "nprocPerNode": 4,
        "parallelism": {"tensor": 4, "pipeline": 3},
        "template": {"spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]}},
    },
}


def with_changes(path: str, value) -> dict:
    manifest = copy.deepcopy(VALID)
    *parents, last = path.split(".")
    node = manifest
    for key in parents:
        node = node.setdefault(key, {})
    if value is None:
        del node[last]
    else:
        node[last] = value
    return manifest


def server_dry_run(kubectl, namespace: str, manifest: dict):
    return kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest), check=False)


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (
            "spec.parallelism.tensor",
            8,
            "spec.parallelism: Invalid value: parallelism.tensor x parallelism.pipeline must divide "
            "the world size (replicas x nprocPerNode)",
        ),
        ("spec.parallelism.data", 7, "spec.parallelism.data: Invalid value"),
        (
            "spec.replicas",
            0,
            "spec.replicas: Invalid value: 0: spec.replicas in body should be greater than or equal to 1",
        ),
        ("spec.tracing", {"sensitivitySeconds": 2}, "spec.tracing.sensitivitySeconds: Invalid value: 2"),
        (
            "spec.tracing",
            {"sensitivitySeconds": 20, "windowSeconds": 30},
            "tracing.windowSeconds must be shorter than tracing.sensitivitySeconds",
        ),
        ("spec.template.spec.containers", [], "spec.template.spec.containers: Invalid value"),
        (
            "spec.template.spec.containers",
            [{"name": "trainer"}],
            "spec.template.spec.containers[0].image: Required value",
        ),
        ("spec.template.spec.restartPolicy", "Always", 'spec.template.spec.restartPolicy: Unsupported value: "Always"'),
        ("spec.template", None, "spec.template: Required value"),
        ("spec.alerting", {"levels": {"hang": "P7"}}, 'spec.alerting.levels.hang: Unsupported value: "P7"'),
        ("metadata.name", "x" * 50, "metadata.name must be at most 45 characters"),
        (
            "spec.tracing",
            {"archive": {"s3": {"bucket": "traces", "region": "eu west 1", "secretRef": {"name": "s"}}}},
            "spec.tracing.archive.s3.region: Invalid value",
        ),
        (
            "spec.tracing",
            {"archive": {"s3": {"bucket": "traces", "prefix": "rankwatch/team-b/llama", "secretRef": {"name": "s"}}}},
            "spec.tracing.archive.s3.prefix: Invalid value",
        ),
        (
            "spec.sidecar",
            {"ptrace": "yes"},
            'spec.sidecar.ptrace: Invalid value: "string": spec.sidecar.ptrace in body must be of type boolean',
        ),
    ],
)
def test_invalid_manifest_is_rejected_naming_the_field(kubectl, crd, unwatched_namespace, path, value, expected):
    result = server_dry_run(kubectl, unwatched_namespace, with_changes(path, value))
    assert result.returncode != 0, f"accepted: {result.stdout}"
    assert expected in result.stderr


def test_valid_manifest_gets_defaults(kubectl, crd, unwatched_namespace):
    result = kubectl(
        "apply", "--dry-run=server", "-o", "yaml", "-n", unwatched_namespace, "-f", "-", input=yaml.safe_dump(VALID)
    )
    spec = yaml.safe_load(result.stdout)["spec"]
    assert spec["tracing"] == {
        "enabled": True,
        "sensitivitySeconds": 300,
        "windowSeconds": 5,
        "gpuTiming": True,
        "flightRecorder": True,
    }
    assert spec["remediation"] == {"cordon": True, "dryRun": False, "maxNodesPerJob": 2}
    assert spec["alerting"]["levels"] == {"hang": "P0", "straggler": "P1", "slowLink": "P1", "degradation": "P2",
                                        "mismatch": "P0"}  # fmt: skip
    assert spec["masterPort"] == 29500
    assert spec["sidecar"] == {"ptrace": False}, "SYS_PTRACE only when the job asks for it"


def test_world_size_cannot_change_after_creation(kubectl, crd, unwatched_namespace):
    kubectl("apply", "-n", unwatched_namespace, "-f", "-", input=yaml.safe_dump(VALID))
    result = kubectl(
        "patch", "tj", "check", "-n", unwatched_namespace, "--type=merge", "-p", '{"spec":{"replicas":30}}', check=False
    )
    assert result.returncode != 0
    assert "replicas is immutable" in result.stderr


def with_trainer(**fields) -> dict:
    """VALID with nprocPerNode 4 and ``fields`` set on its trainer container."""
    manifest = copy.deepcopy(VALID)
    manifest["spec"]["template"]["spec"]["containers"][0].update(fields)
    return manifest


@pytest.mark.parametrize(
    ("where", "typo", "expected"),
    [
        ("container", {"resource": {"limits": {"nvidia.com/gpu": 4}}}, "spec.containers[0].resource"),
        ("pod", {"toleration": [{"key": "gpu", "operator": "Exists"}]}, "spec.toleration"),
        ("metadata", {"label": {"team": "llm"}}, "metadata.label"),
    ],
)
def test_a_typo_in_the_pod_template_is_refused_at_apply(kubectl, crd, unwatched_namespace, where, typo, expected):
    """kubectl apply asks for strict field validation (its default): the API server names the field."""
    manifest = copy.deepcopy(VALID)
    target = {
        "container": manifest["spec"]["template"]["spec"]["containers"][0],
        "pod": manifest["spec"]["template"]["spec"],
        "metadata": manifest["spec"]["template"].setdefault("metadata", {}),
    }[where]
    target.update(typo)
    result = server_dry_run(kubectl, unwatched_namespace, manifest)
    assert result.returncode != 0, f"accepted: {result.stdout}"
    assert f'strict decoding error: unknown field "spec.template.{expected}"' in result.stderr


def test_a_wrongly_typed_pod_template_field_is_refused(kubectl, crd, unwatched_namespace):
    result = server_dry_run(kubectl, unwatched_namespace, with_trainer(resources={"limits": ["nvidia.com/gpu"]}))
    assert result.returncode != 0, f"accepted: {result.stdout}"
    assert "spec.template.spec.containers[0].resources.limits: Invalid value" in result.stderr


def test_a_full_pod_template_is_accepted(kubectl, crd, unwatched_namespace):
    manifest = with_trainer(
        resources={"limits": {"nvidia.com/gpu": 4, "memory": "64Gi"}, "requests": {"cpu": "8"}},
        env=[{"name": "NCCL_DEBUG", "value": "WARN"}],
        volumeMounts=[{"name": "shm", "mountPath": "/dev/shm"}],
        ports=[{"containerPort": 29500}],
    )
    manifest["spec"]["template"]["metadata"] = {"labels": {"team": "llm"}, "creationTimestamp": None}
    manifest["spec"]["template"]["spec"].update(
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        volumes=[{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}],
        nodeSelector={"nvidia.com/gpu.present": "true"},
        priorityClassName="training",
    )
    result = kubectl(
        "apply", "--dry-run=server", "-o", "yaml", "-n", unwatched_namespace, "-f", "-", input=yaml.safe_dump(manifest)
    )
    template = yaml.safe_load(result.stdout)["spec"]["template"]
    assert template["spec"]["tolerations"] == manifest["spec"]["template"]["spec"]["tolerations"]
    assert template["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 4, "memory": "64Gi"}


@pytest.mark.parametrize(
    ("resources", "refused"),
    [
        ({"limits": {"nvidia.com/gpu": 2}}, True),
        ({"limits": {"nvidia.com/gpu": "2"}}, True),
        ({"requests": {"nvidia.com/gpu": 3}}, True),
        ({"limits": {"nvidia.com/gpu": 4}}, False),
        ({"limits": {"nvidia.com/gpu": "8"}}, False),
        ({"limits": {"cpu": "4"}}, False),  # no GPU asked for: a CPU job may run several ranks per pod
    ],
)
def test_gpus_of_the_trainer_must_cover_nproc_per_node(kubectl, crd, unwatched_namespace, resources, refused):
    result = server_dry_run(kubectl, unwatched_namespace, with_trainer(resources=resources))  # nprocPerNode 4
    if refused:
        assert result.returncode != 0, f"accepted: {result.stdout}"
        assert "spec.nprocPerNode: Invalid value: nprocPerNode must not exceed the nvidia.com/gpu" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
