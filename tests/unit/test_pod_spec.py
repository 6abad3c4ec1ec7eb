"""Worker pod construction: what a user's template turns into."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from rankwatch import sidecar_env
from rankwatch.operator.config import WorkerPodSettings
from rankwatch.operator.lifecycle import pod_spec
from rankwatch.operator.spec import InvalidSpec, Parallelism, Sidecar, Tracing, TrainingJobSpec
from rankwatch.sidecar import config as sidecar_config

CONFIG = WorkerPodSettings(image="registry.example/rankwatch:test", collector_url="http://collector:8080")
JOB = {"metadata": {"name": "llama", "namespace": "team-a", "uid": "uid-123"}}
TEMPLATE = {
    "metadata": {"labels": {"team": "llm"}, "annotations": {"note": "keep"}},
    "spec": {
        "containers": [
            {
                "name": "trainer",
                "image": "pytorch:latest",
                "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            }
        ],
        "volumes": [{"name": "data", "emptyDir": {}}],
        "nodeSelector": {"rankwatch.io/node-pool": "gpu"},
    },
}


def make_spec(**overrides) -> TrainingJobSpec:
    values = dict(template=copy.deepcopy(TEMPLATE), replicas=4, nprocPerNode=8, parallelism=Parallelism(8, 2))
    values.update(overrides)
    return TrainingJobSpec(**values)


def env_of(container: dict) -> dict[str, str]:
    return {item["name"]: item.get("value") for item in container.get("env", [])}


def container(pod: dict, name: str) -> dict:
    everything = pod["spec"]["containers"] + pod["spec"].get("initContainers", [])
    return next(c for c in everything if c["name"] == name)


def test_rendezvous_env_matches_torchrun_conventions():
    pod = pod_spec.worker_pod(JOB, make_spec(), 2, CONFIG)
    env = env_of(container(pod, "trainer"))
    assert env["MASTER_ADDR"] == "llama-worker-0.llama.team-a.svc"
    assert env["MASTER_PORT"] == "29500"
    assert (env["NNODES"], env["NODE_RANK"], env["NPROC_PER_NODE"], env["WORLD_SIZE"]) == ("4", "2", "8", "32")
    assert (env["PET_NNODES"], env["PET_NODE_RANK"], env["PET_NPROC_PER_NODE"]) == ("4", "2", "8")
    assert env["PET_MASTER_ADDR"] == env["MASTER_ADDR"]
    assert env["NCCL_DEBUG"] == "WARN", "the user's own env is kept"


def test_a_later_attempt_has_new_names_a_new_rendezvous_and_avoids_uncordoned_suspects():
    spec = make_spec()
    spec.template["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
                ]
            }
        }
    }
    pod = pod_spec.worker_pod(JOB, spec, 1, CONFIG, attempt=2, avoid_nodes=["gpu-7", "gpu-3"])
    env = env_of(container(pod, "trainer"))
    assert pod["metadata"]["name"] == pod["spec"]["hostname"] == "llama-r2-worker-1"
    assert pod["metadata"]["labels"]["rankwatch.io/attempt"] == "2"
    assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "llama-r2-worker-0.llama.team-a.svc"
    assert env["RANKWATCH_ATTEMPT"] == "2" and env["NODE_RANK"] == "1"
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    avoid = {"key": "metadata.name", "operator": "NotIn", "values": ["gpu-3", "gpu-7"]}
    assert [term["matchFields"] for term in terms["nodeSelectorTerms"]] == [[avoid], [avoid]]
    assert terms["nodeSelectorTerms"][1]["matchExpressions"][0]["values"] == ["b"], "the template's terms are kept"
    assert "affinity" not in pod_spec.worker_pod(JOB, make_spec(), 1, CONFIG, attempt=1)["spec"]


def test_pod_identity_labels_owner_and_dns():
    pod = pod_spec.worker_pod(JOB, make_spec(), 3, CONFIG)
    meta = pod["metadata"]
    assert meta["name"] == "llama-worker-3" and meta["namespace"] == "team-a"
    assert meta["labels"] == {
        "team": "llm",
        "rankwatch.io/job-name": "llama",
        "rankwatch.io/replica-index": "3",
        "rankwatch.io/attempt": "0",
        "rankwatch.io/traced": "true",
        "app.kubernetes.io/managed-by": "rankwatch",
    }
    assert meta["annotations"]["note"] == "keep"
    [owner] = meta["ownerReferences"]
    assert owner["kind"] == "TrainingJob" and owner["uid"] == "uid-123" and owner["controller"] is True
    assert pod["spec"]["hostname"] == "llama-worker-3" and pod["spec"]["subdomain"] == "llama"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["nodeSelector"] == {"rankwatch.io/node-pool": "gpu"}


def test_tracing_injection_init_container_preload_and_sidecar():
    pod = pod_spec.worker_pod(JOB, make_spec(tracing=Tracing(gpuTiming=True, sensitivitySeconds=120)), 0, CONFIG)
    init, sidecar = pod["spec"]["initContainers"][:2]
    assert init["name"] == "rankwatch-init" and init["image"] == CONFIG.image
    assert init["command"] == ["cp", "/opt/rankwatch/lib/librankwatch-nccl.so", "/rankwatch/lib/librankwatch-nccl.so"]
    assert sidecar["name"] == "rankwatch-sidecar" and sidecar["restartPolicy"] == "Always"
    assert sidecar["command"] == ["rankwatch", "sidecar"]
    sidecar_vars = env_of(sidecar)
    assert sidecar_vars["RANKWATCH_COLLECTOR_URL"] == "http://collector:8080"
    assert sidecar_vars["RANKWATCH_TOKEN_FILE"] == "/var/run/secrets/rankwatch/token"
    assert sidecar_vars["RANKWATCH_SENSITIVITY_SECONDS"] == "120"
    assert {m["name"] for m in sidecar["volumeMounts"]} == {
        "rankwatch-traces",
        "rankwatch-token",
        "rankwatch-no-api-token",
    }

    trainer = container(pod, "trainer")
    env = env_of(trainer)
    assert env["LD_PRELOAD"] == "/rankwatch/lib/librankwatch-nccl.so"
    assert env["RANKWATCH_TRACE_DIR"] == "/rankwatch/traces"
    assert env["RANKWATCH_GPU_TIMING"] == "1"
    node = next(item for item in trainer["env"] if item["name"] == "RANKWATCH_NODE_NAME")
    assert node["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].startswith("/rankwatch/traces/")
    mounts = {m["name"]: m for m in trainer["volumeMounts"]}
    assert mounts["rankwatch-lib"]["readOnly"] is True
    assert "data" in mounts, "the user's mounts are kept"
    assert "rankwatch-token" not in mounts, "only the sidecar holds the job's token"

    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert set(volumes) == {"data", "rankwatch-lib", "rankwatch-traces", "rankwatch-token", "rankwatch-no-api-token"}
    assert volumes["rankwatch-token"]["secret"]["secretName"] == "llama-rankwatch-token"


def test_the_sidecar_reads_every_variable_the_pod_builder_sets_and_the_builder_sets_all_it_needs():
    """The names come from one module (``rankwatch.sidecar_env``); this holds the two sides to it: the
    sidecar's settings loaded from the built container's env carry the job's values, not defaults."""
    spec = make_spec(tracing=Tracing(sensitivitySeconds=120, windowSeconds=2))
    pod = pod_spec.worker_pod(JOB, spec, 3, CONFIG)
    built = container(pod, "rankwatch-sidecar")["env"]
    read = {variable for _, variable, _, _ in sidecar_config.SETTINGS.values() if variable}
    assert {item["name"] for item in built} == read - sidecar_env.NOT_SET_BY_THE_OPERATOR
    downward = {"metadata.name": "llama-worker-3", "spec.nodeName": "node-7"}
    environ = {
        item["name"]: item["value"] if "value" in item else downward[item["valueFrom"]["fieldRef"]["fieldPath"]]
        for item in built
    }
    loaded = sidecar_config.load(environ=environ)
    assert (loaded.job, loaded.namespace, loaded.pod, loaded.node) == (
        "llama",
        "team-a",
        "llama-worker-3",
        "node-7",
    )
    assert (loaded.replica_index, loaded.nproc_per_node, loaded.window_s, loaded.sensitivity_s) == (3, 8, 2.0, 120.0)
    assert (loaded.collector_url, loaded.port) == ("http://collector:8080", CONFIG.sidecar_metrics_port)


def test_the_job_token_is_readable_by_the_sidecar_alone_and_no_api_token_reaches_it():
    """The pod shares its process namespace (the sidecar watches the trainer's pids): the token file is
    not world-readable, the sidecar reads it through its group, and it sees no service-account token."""
    pod = pod_spec.worker_pod(JOB, make_spec(), 0, CONFIG)
    assert pod["spec"]["shareProcessNamespace"] is True
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mode = volumes["rankwatch-token"]["secret"]["defaultMode"]
    assert mode & 0o007 == 0, f"token file mode {mode:o} is readable by others"
    sidecar = pod["spec"]["initContainers"][1]
    assert mode & 0o040 and sidecar["securityContext"]["runAsGroup"] == 0, "the sidecar reads it through its group"
    assert sidecar["securityContext"]["runAsNonRoot"] is True and sidecar["securityContext"]["runAsUser"] != 0
    hidden = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}
    assert hidden["/var/run/secrets/kubernetes.io/serviceaccount"] == "rankwatch-no-api-token"
    assert "emptyDir" in volumes["rankwatch-no-api-token"]
    assert pod["spec"]["automountServiceAccountToken"] is False, "no API token unless the template asks"
    spec = make_spec()
    spec.template["spec"]["automountServiceAccountToken"] = True
    assert pod_spec.worker_pod(JOB, spec, 0, CONFIG)["spec"]["automountServiceAccountToken"] is True


def test_user_ld_preload_is_kept_after_ours():
    spec = make_spec()
    spec.template["spec"]["containers"][0]["env"].append({"name": "LD_PRELOAD", "value": "/usr/lib/libjemalloc.so"})
    env = env_of(container(pod_spec.worker_pod(JOB, spec, 0, CONFIG), "trainer"))
    assert env["LD_PRELOAD"] == "/rankwatch/lib/librankwatch-nccl.so:/usr/lib/libjemalloc.so"


def test_traced_pod_shares_its_process_namespace_so_the_sidecar_sees_trainer_pids():
    assert pod_spec.worker_pod(JOB, make_spec(), 0, CONFIG)["spec"]["shareProcessNamespace"] is True
    untraced = pod_spec.worker_pod(JOB, make_spec(tracing=Tracing(enabled=False)), 0, CONFIG)
    assert "shareProcessNamespace" not in untraced["spec"]


def test_tracing_disabled_adds_only_rendezvous():
    spec = make_spec(tracing=Tracing(enabled=False))
    pod = pod_spec.worker_pod(JOB, spec, 1, CONFIG)
    assert "initContainers" not in pod["spec"]
    env = env_of(container(pod, "trainer"))
    assert "LD_PRELOAD" not in env and "RANKWATCH_TRACE_DIR" not in env
    assert env["NODE_RANK"] == "1"
    assert pod["metadata"]["annotations"]["rankwatch.io/tracing"] == "disabled"


def test_flight_recorder_off_sets_no_torch_env():
    env = env_of(
        container(pod_spec.worker_pod(JOB, make_spec(tracing=Tracing(flightRecorder=False)), 0, CONFIG), "trainer")
    )
    assert not [name for name in env if name.startswith("TORCH_")]


def test_template_is_not_mutated():
    spec = make_spec()
    before = copy.deepcopy(spec.template)
    pod_spec.worker_pod(JOB, spec, 0, CONFIG)
    pod_spec.worker_pod(JOB, spec, 1, CONFIG)
    assert spec.template == before


@pytest.mark.parametrize("name", ["MASTER_ADDR", "WORLD_SIZE", "PET_NNODES"])
def test_template_setting_a_managed_variable_is_refused_with_its_name(name):
    spec = make_spec()
    spec.template["spec"]["containers"][0]["env"].append({"name": name, "value": "x"})
    with pytest.raises(InvalidSpec, match=f"team-a/llama.*'trainer' sets {name}"):
        pod_spec.worker_pod(JOB, spec, 0, CONFIG)


def test_reserved_container_and_volume_names_are_refused():
    spec = make_spec()
    spec.template["spec"]["containers"][0]["name"] = "rankwatch-sidecar"
    with pytest.raises(InvalidSpec, match="container name 'rankwatch-sidecar' is reserved"):
        pod_spec.worker_pod(JOB, spec, 0, CONFIG)
    spec = make_spec()
    spec.template["spec"]["volumes"].append({"name": "rankwatch-traces", "emptyDir": {}})
    with pytest.raises(InvalidSpec, match="volume name 'rankwatch-traces' is reserved"):
        pod_spec.worker_pod(JOB, spec, 0, CONFIG)


def test_a_template_binding_workers_to_a_node_is_refused():
    """nodeName bypasses the scheduler: a job could put a worker on another team's node."""
    spec = make_spec()
    spec.template["spec"]["nodeName"] = "gpu-node-of-team-b"
    with pytest.raises(InvalidSpec, match=r"team-a/llama: spec\.template\.spec\.nodeName is not allowed"):
        pod_spec.worker_pod(JOB, spec, 0, CONFIG)


def test_headless_service_publishes_not_ready_workers():
    service = pod_spec.headless_service(JOB, make_spec(masterPort=23456))
    assert service["metadata"]["name"] == "llama"
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"rankwatch.io/job-name": "llama"}
    assert service["spec"]["ports"][0]["port"] == 23456


def test_token_secret_is_random_per_call():
    first, second = pod_spec.token_secret(JOB), pod_spec.token_secret(JOB)
    assert first["metadata"]["name"] == "llama-rankwatch-token"
    assert len(first["stringData"]["token"]) >= 40
    assert first["stringData"]["token"] != second["stringData"]["token"]


def test_pull_secrets_for_rankwatchs_image_come_from_the_chart_and_the_job_after_the_templates():
    spec = make_spec(tracing=Tracing(imagePullSecrets=("team-registry", "shared")))
    spec.template["spec"]["imagePullSecrets"] = [{"name": "trainer-registry"}, {"name": "shared"}]
    config = WorkerPodSettings(image=CONFIG.image, collector_url=CONFIG.collector_url, image_pull_secrets=("shared",))
    pod = pod_spec.worker_pod(JOB, spec, 0, config)
    assert pod["spec"]["imagePullSecrets"] == [
        {"name": "trainer-registry"},
        {"name": "shared"},
        {"name": "team-registry"},
    ]
    untraced = pod_spec.worker_pod(JOB, make_spec(tracing=Tracing(enabled=False)), 0, config)
    assert "imagePullSecrets" not in untraced["spec"], "without tracing no rankwatch image is pulled"


def test_the_jobs_pull_secrets_are_read_from_the_stored_spec():
    spec = TrainingJobSpec.from_manifest(
        {"template": TEMPLATE, "tracing": {"imagePullSecrets": [{"name": "team-registry"}]}}
    )
    assert spec.tracing.imagePullSecrets == ("team-registry",)


def test_a_job_in_a_kueue_queue_makes_one_pod_group_per_attempt_and_generation():
    queued = {"metadata": {**JOB["metadata"], "generation": 3, "labels": {"kueue.x-k8s.io/queue-name": "gpus"}}}
    pods = [pod_spec.worker_pod(queued, make_spec(), index, CONFIG, attempt=1) for index in range(4)]
    for pod in pods:
        labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
        assert labels["kueue.x-k8s.io/queue-name"] == "gpus"
        assert labels["kueue.x-k8s.io/pod-group-name"] == "llama-a1-g3"
        assert annotations["kueue.x-k8s.io/pod-group-total-count"] == "4"
        assert annotations["kueue.x-k8s.io/retriable-in-group"] == "false", "rankwatch replaces attempts itself"
    later = pod_spec.worker_pod(queued, make_spec(), 0, CONFIG, attempt=2)
    assert later["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "llama-a2-g3"


def test_a_queue_label_on_the_template_alone_still_makes_a_gang():
    template = copy.deepcopy(TEMPLATE)
    template["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = "gpus"
    job = {"metadata": JOB["metadata"], "spec": {"template": template}}
    pod = pod_spec.worker_pod(job, make_spec(template=template), 0, CONFIG)
    assert pod["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "llama-a0-g1"
    assert pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "4"


def test_a_job_in_no_queue_gets_no_pod_group():
    pod = pod_spec.worker_pod(JOB, make_spec(), 0, CONFIG)
    assert not any(key.startswith("kueue.x-k8s.io/") for key in pod["metadata"]["labels"])
    assert not any(key.startswith("kueue.x-k8s.io/") for key in pod["metadata"]["annotations"])


def test_a_pod_group_name_stays_a_valid_label_value_for_the_longest_job_names():
    from rankwatch.operator.lifecycle import gang

    name = gang.pod_group_name("j" * 45, attempt=99, generation=10**12)
    assert len(name) <= 63 and name.startswith("j" * 40)
    assert name != gang.pod_group_name("j" * 45, attempt=99, generation=10**12 + 1)


def test_the_sidecar_gets_sys_ptrace_only_when_the_job_asks_for_it():
    """``spec.sidecar.ptrace``: SYS_PTRACE and nothing else, as root (an added capability reaches a root
    container's effective set only); off by default, and the trainer is never given anything."""
    plain = container(pod_spec.worker_pod(JOB, make_spec(), 0, CONFIG), pod_spec.SIDECAR_CONTAINER)
    assert plain["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert plain["securityContext"]["runAsNonRoot"] is True

    pod = pod_spec.worker_pod(JOB, make_spec(sidecar=Sidecar(ptrace=True)), 0, CONFIG)
    context = container(pod, pod_spec.SIDECAR_CONTAINER)["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE"]}
    assert (context["runAsUser"], context["runAsNonRoot"], context["allowPrivilegeEscalation"]) == (0, False, False)
    assert context["readOnlyRootFilesystem"] is True and context["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["spec"]["shareProcessNamespace"] is True, "py-spy must see the ranks' processes"
    assert "securityContext" not in container(pod, "trainer")
    assert container(pod, pod_spec.INIT_CONTAINER)["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_a_job_asking_for_ptrace_where_the_admin_disallows_it_is_refused_naming_the_setting():
    refusing = dataclasses.replace(CONFIG, allow_ptrace=False)
    with pytest.raises(InvalidSpec, match=r"team-a/llama: spec\.sidecar\.ptrace is not allowed .*sidecar\.allowPtrace"):
        pod_spec.worker_pod(JOB, make_spec(sidecar=Sidecar(ptrace=True)), 0, refusing)
    assert pod_spec.worker_pod(JOB, make_spec(), 0, refusing), "a job that does not ask is built as always"


def test_a_traced_worker_carries_the_label_the_network_policies_admit():
    assert pod_spec.worker_pod(JOB, make_spec(), 0, CONFIG)["metadata"]["labels"]["rankwatch.io/traced"] == "true"
    untraced = pod_spec.worker_pod(JOB, make_spec(tracing=Tracing(enabled=False)), 0, CONFIG)
    assert "rankwatch.io/traced" not in untraced["metadata"]["labels"], "no sidecar: nothing to admit"


@pytest.mark.parametrize(
    ("toleration", "refused"),
    [
        # The cordon's own taint: a cordoned node is kept from such a pod by rankwatch's taint, not the cordon.
        ({"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"}, False),
        ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}, False),
        ({"operator": "Exists", "effect": "NoExecute"}, False),  # key-less, but not the effect of rankwatch's taint
        ({"operator": "Exists"}, True),  # every taint
        ({"operator": "Exists", "effect": "NoSchedule"}, True),
        ({"key": "rankwatch.io/suspect", "operator": "Exists"}, True),
        ({"key": "rankwatch.io/suspect", "operator": "Equal", "value": "team-a.llama", "effect": "NoSchedule"}, True),
    ],
)
def test_a_template_tolerating_rankwatchs_suspect_taint_is_refused(toleration, refused):
    spec = make_spec()
    spec.template["spec"]["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists"}, toleration]
    if refused:
        with pytest.raises(InvalidSpec, match=r"team-a/llama: spec\.template\.spec\.tolerations\[1\] tolerates "
                           r"rankwatch's taint rankwatch\.io/suspect:NoSchedule"):  # fmt: skip
            pod_spec.worker_pod(JOB, spec, 0, CONFIG)
    else:
        assert pod_spec.worker_pod(JOB, spec, 0, CONFIG)["spec"]["tolerations"][1] == toleration
