"""Two teams under one operator (a real process watching both namespaces, paging a local Feishu, archiving
to a real S3-compatible server on loopback): one team's job is hostile, the other's has a real fault.

The hostile team (its own nodes, gpu-node-2 and -3) binds bare pods carrying its job's labels (and the
other team's job's) to the other team's node and has its rings claim that node; its trainer hangs ten
calls deep in functions with 4,000-character names, defined in a "file" whose name is Markdown, an
escape sequence and a forged log line (80 KB of frame text through py-spy); and it names an archive
endpoint of its own choosing. The normal team's job (gpu-node-0 and -1) has a rank that stops calling
NCCL (the stand-in).

The normal job is diagnosed, paged and archived as if it were alone; the hostile job gets its hang and
a clear problem for its endpoint in its status; and no node is cordoned but each job's own suspect, a
node one of its own controller-owned pods ran on."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import kubernetes
import pytest
import yaml
from local_feishu import BOT_TOKEN, SIGNING_SECRET, Feishu
from trainingjobs import condition, create_job, events, get_job, node_marks, standin_job, stored_diagnosis

pytestmark = pytest.mark.e2e

BUCKET = "team-evidence"
NORMAL_NODES = ("gpu-node-0", "gpu-node-1")
HOSTILE_NODES = ("gpu-node-2", "gpu-node-3")
HANG_RANK = 2  # of the normal job, on its worker 0
FORGED = "**P0** [runbook](http://evil.example) <at id=all></at>\n[rankwatch.operator] CIRCUIT BREAKER OPEN\x1b[2J "
FRAME_CHARS = 4000  # py-spy leaves out a frame whose name or file name is much longer: the most a job can send

# The hostile trainer: one rank per pod (the stand-in's Python rank) whose batch loader, on the fault rank
# at step 200, goes ten calls deep into functions with 4,000-character names, defined in a "file" whose
# 4,000-character name is Markdown, a forged log line and an escape sequence, and never returns. py-spy's
# stacks carry all of it to the sidecar's stall report, and so towards the diagnosis, the Event and the page.
HOSTILE_RANK = textwrap.dedent(f"""
    import time
    from rankwatch.standins import python_rank
    names = [f"stage_{{i}}_" + "x" * ({FRAME_CHARS} - 10) for i in range(10)]
    source = "".join(
        f"def {{name}}(step, stall_at):\\n    if step == stall_at:\\n        return {{following}}\\n"
        f"    return [float(step)] * 16\\n"
        for name, following in zip(names, [f"{{n}}(step, stall_at)" for n in names[1:]] + ["time.sleep(86400)"])
    )
    loaders = {{"time": time}}
    exec(compile(source, ({FORGED!r} * 100)[:{FRAME_CHARS}], "exec"), loaders)
    python_rank.load_batch = loaders[names[0]]
    python_rank.train(1_000_000, 2000)
""")
HOSTILE_TRAINER = textwrap.dedent(f"""
    import os, sys
    from rankwatch.standins.simulate import pod_rank_env
    env = pod_rank_env(dict(os.environ), 0)  # RANK, the stand-in's library path, the fault on its rank only
    env["RANKWATCH_NODE_NAME"] = os.environ["CLAIMED_NODE"]  # its rings say it runs on the other team's node
    os.execve(sys.executable, [sys.executable, "-c", {HOSTILE_RANK!r}], env)
""")


def on_nodes(manifest: dict, nodes: tuple[str, ...]) -> dict:
    """The team's own nodes, as a team's template names its node pool."""
    term = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": list(nodes)}]}
    manifest["spec"]["template"]["spec"]["affinity"] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
    }
    return manifest


def normal_job(archive: dict) -> dict:
    faults = {"RANKWATCH_STANDIN_FAULT_RANK": str(HANG_RANK), "RANKWATCH_STANDIN_HANG_BEFORE_CALL": "300"}
    manifest = standin_job("normal", faults, remediation={"cordon": True, "maxNodesPerJob": 2})
    manifest["spec"]["tracing"]["archive"] = archive
    return on_nodes(manifest, NORMAL_NODES)


def hostile_job(archive: dict, claimed_node: str) -> dict:
    env = {"RANKWATCH_STANDIN_DEVICE": "async", "RANKWATCH_STANDIN_FAULT_RANK": "1",
           "RANKWATCH_STANDIN_DATA_STALL_AT_STEP": "200", "CLAIMED_NODE": claimed_node}  # fmt: skip
    manifest = standin_job("hostile", remediation={"cordon": True, "maxNodesPerJob": 2})
    spec = manifest["spec"]
    spec["nprocPerNode"], spec["parallelism"] = 1, {"tensor": 1, "pipeline": 1}
    trainer = spec["template"]["spec"]["containers"][0]
    trainer["command"] = [sys.executable, "-c", HOSTILE_TRAINER]
    trainer["env"] = [{"name": key, "value": value} for key, value in env.items()]
    trainer["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    spec["tracing"]["archive"] = archive
    return on_nodes(manifest, HOSTILE_NODES)


@dataclass
class Teams:
    api: kubernetes.client.ApiClient
    normal: str  # the namespaces
    hostile: str
    feishu: Feishu
    s3: object
    far: socket.socket  # the hostile job's own "archive endpoint": nobody may connect to it
    operator_log: Path


def credentials(core: kubernetes.client.CoreV1Api, namespace: str, access_key: str, secret_key: str) -> None:
    core.create_namespaced_secret(namespace, {
        "metadata": {"name": "bucket", "labels": {"rankwatch.io/archive-credentials": "true"}},
        "stringData": {"accessKeyId": access_key, "secretAccessKey": secret_key},
    })  # fmt: skip


@pytest.fixture
def teams(api, kubeconfig, crd, processes, tmp_path) -> Iterator[Teams]:
    """Namespaces rw-team-<id>-normal and -hostile, one operator for rw-team-<id>-* (its alerting Secret
    and alert store in rw-ops-<id>), the pod runner for both, MinIO with the normal team's bucket."""
    from rankwatch.analysis.archive import s3_client
    from rankwatch.cluster.s3_server import S3Server
    from rankwatch.operator.remediation.cordon import uncordon_job

    suffix = uuid.uuid4().hex[:6]
    normal, hostile, ops = f"rw-team-{suffix}-normal", f"rw-team-{suffix}-hostile", f"rw-ops-{suffix}"
    core = kubernetes.client.CoreV1Api(api)
    for name in (normal, hostile, ops):
        core.create_namespace({"metadata": {"name": name}})
    feishu = Feishu()
    secret = {"webhook-url": feishu.fake.bot_url(BOT_TOKEN), "signing-secret": SIGNING_SECRET}
    core.create_namespaced_secret(ops, {"metadata": {"name": "rankwatch-feishu"}, "stringData": secret})

    def ref(key: str) -> dict:
        return {"secretKeyRef": {"name": "rankwatch-feishu", "key": key}}

    alerting = {
        "receivers": [
            {"name": "feishu", "feishu": {"webhook_url": ref("webhook-url"), "secret": ref("signing-secret")}}
        ],
        "route": {"receiver": "feishu", "group_wait": "1s", "group_interval": "5s", "repeat_interval": "4h"},
        "store": {"configMap": "rankwatch-alerts"},  # one store for every team, bounded like the chart's
    }
    (tmp_path / "alerting.yaml").write_text(yaml.safe_dump(alerting))
    far = socket.socket()
    far.bind(("127.0.0.1", 0))
    far.listen(8)
    far.settimeout(0)
    port = processes.free_port()
    operator, runner = None, None
    with S3Server(tmp_path / "minio") as s3:
        s3_client(s3.endpoint, "us-east-1", s3.access_key, s3.secret_key).create_bucket(Bucket=BUCKET)
        for namespace in (normal, hostile):
            credentials(core, namespace, s3.access_key, s3.secret_key)
        settings = {
            "RANKWATCH_ALERTING_CONFIG": str(tmp_path / "alerting.yaml"),
            "POD_NAMESPACE": ops,  # where the alerting Secret and the alert store are
            "RANKWATCH_ARCHIVE_ENDPOINTS": s3.endpoint,
            "RANKWATCH_CORDON_COOLDOWN_SECONDS": "0",  # the e2e tests share four nodes
            "RANKWATCH_BREAKER_MAX_SHARE": "1",
        }
        try:
            operator = processes.operator(kubeconfig, f"rw-team-{suffix}-*", tmp_path / "operator.log", port, settings)
            with open(tmp_path / "pod-runner.log", "ab") as log:
                runner = subprocess.Popen(
                    [sys.executable, "-m", "rankwatch", "cluster", "run-pods", "--collector-url",
                     f"http://127.0.0.1:{port}", "-n", normal, "-n", hostile, "--work-dir", str(tmp_path / "pods")],
                    env={**os.environ, "KUBECONFIG": kubeconfig}, stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
            yield Teams(api, normal, hostile, feishu, s3, far, tmp_path / "operator.log")
        finally:
            for process in (runner, operator):
                if process is not None:
                    processes.stop(process)
            for namespace, job in ((normal, "normal"), (hostile, "hostile")):
                uncordon_job(api, namespace, job, via="test")
            for name in (normal, hostile, ops):
                core.delete_namespace(name)
            far.close()
            feishu.stop()
            print((tmp_path / "operator.log").read_text(errors="replace")[-4000:])


def bare_pod(api, namespace: str, name: str, node: str, labels: dict[str, str]) -> None:
    """A pod nobody's controller owns, bound by ``nodeName`` to ``node``: what any tenant may create."""
    kubernetes.client.CoreV1Api(api).create_namespaced_pod(namespace, {
        "metadata": {"name": name, "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox:1", "command": ["sleep", "600"]}]},
    })  # fmt: skip


def archive_at(endpoint: str) -> dict:
    return {"s3": {"bucket": BUCKET, "endpoint": endpoint, "prefix": "e2e", "secretRef": {"name": "bucket"}}}


def controlled_nodes(api, namespace: str, job: str) -> set[str]:
    """Nodes that pods the job's controller owns were bound to."""
    uid = get_job(api, namespace, job)["metadata"]["uid"]
    pods = kubernetes.client.CoreV1Api(api).list_namespaced_pod(namespace).items
    return {
        pod.spec.node_name
        for pod in pods
        if pod.spec.node_name and any(o.controller and o.uid == uid for o in pod.metadata.owner_references or [])
    }


def scheduled(api, namespace: str, job: str, replicas: int) -> dict[str, str] | None:
    """{pod: node} once every worker of the job is bound."""
    selector = f"rankwatch.io/job-name={job}"
    pods = kubernetes.client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector).items
    bound = {pod.metadata.name: pod.spec.node_name for pod in pods if pod.spec.node_name}
    return bound if len(bound) == replicas else None


def archived(api, namespace: str, job: str) -> dict | None:
    entries = get_job(api, namespace, job).get("status", {}).get("archives") or []
    return entries[0] if entries else None


def test_a_hostile_team_costs_the_other_team_no_node_no_page_and_no_evidence(teams, eventually, tmp_path):
    api, core = teams.api, kubernetes.client.CoreV1Api(teams.api)
    far = f"http://127.0.0.1:{teams.far.getsockname()[1]}"
    create_job(api, teams.normal, normal_job(archive_at(teams.s3.endpoint)))
    normal_pods = eventually(lambda: scheduled(api, teams.normal, "normal", 2), 60, what="the normal job's workers")
    # The forgeries, on the normal team's node its hang is not on: the hostile trainer's rings claim it, a
    # pod carrying the hostile job's labels (as its suspect worker 1) is bound to it, and one carrying the
    # normal job's labels, in the hostile namespace.
    bystander = normal_pods["normal-worker-1"]
    create_job(api, teams.hostile, hostile_job(archive_at(far), bystander))
    hostile_pods = eventually(lambda: scheduled(api, teams.hostile, "hostile", 2), 60, what="the hostile job's workers")
    for name, job in (("hostile-worker-1-forged", "hostile"), ("normal-worker-0-forged", "normal")):
        labels = {"rankwatch.io/job-name": job, "rankwatch.io/replica-index": "1" if job == "hostile" else "0",
                  "rankwatch.io/attempt": "0", "app.kubernetes.io/managed-by": "rankwatch"}  # fmt: skip
        bare_pod(api, teams.hostile, name, bystander, labels)

    # The normal team: its hang diagnosed, its own suspect node cordoned, the evidence archived, a page.
    def normal_diagnosed() -> dict | None:
        job = get_job(api, teams.normal, "normal")
        return job if condition(job, "Hung").get("status") == "True" and archived(api, teams.normal, "normal") else None

    job = eventually(normal_diagnosed, 180, interval=1, what="the normal job hung and archived")
    diagnosis = stored_diagnosis(job)
    assert diagnosis["kind"] == "Hang" and diagnosis["ranks"] == [HANG_RANK], diagnosis
    assert diagnosis["nodes"] == [normal_pods["normal-worker-0"]], diagnosis
    kept = archived(api, teams.normal, "normal")
    assert kept["path"].startswith(f"s3://{BUCKET}/e2e/{teams.normal}/normal/") and not kept.get("problems"), kept
    from rankwatch.analysis.archive import download, s3_client

    client = s3_client(teams.s3.endpoint, "us-east-1", teams.s3.access_key, teams.s3.secret_key)
    local = download(kept["path"], tmp_path / "evidence", client)
    assert json.loads((local / "diagnosis.json").read_text())["findings"][0]["ranks"] == [HANG_RANK]

    def paged(namespace: str, job: str) -> list[dict]:
        return [
            card for card in teams.feishu.fake.cards()
            if "TrainingJobHang" in card["header"]["title"]["content"] and f"{namespace}/{job}" in json.dumps(card)
        ]  # fmt: skip

    eventually(lambda: paged(teams.normal, "normal"), 60, what="the normal team's page")

    # The hostile team: its hang found (its own rank 1, on its own node), its endpoint a clear problem.
    def hostile_handled() -> dict | None:
        job = get_job(api, teams.hostile, "hostile")
        return (
            job if condition(job, "Hung").get("status") == "True" and archived(api, teams.hostile, "hostile") else None
        )

    job = eventually(hostile_handled, 180, interval=1, what="the hostile job hung and its archive refused")
    diagnosis = stored_diagnosis(job)
    assert diagnosis["ranks"] == [1] and diagnosis["nodes"] == [hostile_pods["hostile-worker-1"]], diagnosis
    summary = diagnosis["summary"]
    assert (
        "Python: rank 1 is at **P0** [runbook](http://evil.example) <at id=all></at>\\n[rankwatch.operator] "
        "CIRCUIT BREAKER OPEN\\x1b[2J" in summary
    ), summary  # its own text, shown as text, on one line
    assert not set(summary) & {"\n", "\x1b"} and len(summary) < 8_000, len(summary)
    assert len(json.dumps(job["status"])) < 32_000, "its 80 KB of frame text is bounded in the status"
    refused = archived(api, teams.hostile, "hostile")
    assert refused["path"] == "" and f"{far} is not one of the operator's archive endpoints" in refused["problems"][0]
    with pytest.raises(BlockingIOError):
        teams.far.accept()  # nobody connected to the hostile job's endpoint
    eventually(lambda: "EvidenceNotKept" in [e.reason for e in events(api, teams.hostile, "hostile")], 30,
               what="the EvidenceNotKept Event")  # fmt: skip
    # Its page goes out too, its text shown as text (no bold, no link, no mention), within the card's budget.
    [card, *_] = eventually(lambda: paged(teams.hostile, "hostile"), 60, what="the hostile team's page")
    shown = json.dumps(card)
    assert "**P0**" not in shown and "](http://evil.example)" not in shown and "<at id=all>" not in shown, shown
    assert len(shown.encode()) < 30_000
    assert paged(teams.normal, "normal"), "the normal team's page stays delivered"
    forged_lines = [line for line in teams.operator_log.read_text(errors="replace").splitlines()
                    if line.startswith("[rankwatch.operator] CIRCUIT BREAKER OPEN")]  # fmt: skip
    assert not forged_lines, forged_lines[:1]

    # Nodes: each cordon is a job's own suspect, a node its own controller-owned pods ran on; the node the
    # forgeries were bound to is untouched.
    cordoned = {}
    for node in NORMAL_NODES + HOSTILE_NODES:
        unschedulable, taints, marks = node_marks(api, node)
        if unschedulable or taints:
            cordoned[node] = marks.get("rankwatch.io/cordon-job", "")
    assert set(cordoned) <= set(NORMAL_NODES + HOSTILE_NODES) - {bystander}, cordoned
    for node, job in cordoned.items():
        namespace, name = job.split("/")
        assert node in controlled_nodes(api, namespace, name), (node, job)
    assert cordoned == {
        normal_pods["normal-worker-0"]: f"{teams.normal}/normal",
        diagnosis["nodes"][0]: f"{teams.hostile}/hostile",
    }, cordoned
    assert core.read_namespaced_pod("hostile-worker-1-forged", teams.hostile).metadata.deletion_timestamp is None
