"""The e2e pod runner: what a kubelet would do for TrainingJob pods bound to kwok's fake nodes.

kwok marks pods Running but runs nothing. For tests and the demo this runner does it for real, from
the pod spec the operator built (so the injection is proven, not assumed): for every worker pod
(label ``rankwatch.io/job-name``; in the namespaces named, also every pod the admission webhook
injected, annotation ``rankwatch.io/tracing: enabled``: an Indexed Job's, a JobSet's...) bound to a
node and Running, it

- makes each volume a directory (emptyDir; Secret volumes with the Secret's keys as files),
- runs the ``rankwatch-init`` container's copy of the tracing library into the library volume,
- starts the trainer container's command and the native sidecar (``rankwatch sidecar``) as local
  processes with the container's env: fieldRefs resolved, mount paths rewritten to the volume
  directories, ``rankwatch`` commands run with this Python; the sidecar on a free loopback port,
  sending to ``collector_url`` (the operator's collector as this machine reaches it),
- annotates the pod ``rankwatch.io/sidecar-endpoint: http://127.0.0.1:<port>`` (kwok pod IPs are
  not routable; the operator's diagnosis reads this annotation),
- when the trainer exits, annotates ``kwok.rankwatch.io/exit-code`` so kwok completes the pod
  (Succeeded / Failed), then stops the sidecar with SIGTERM (it ships its last window).

Pods of one job meet through the stand-in NCCL on this machine: the runner gives every pod of a job
the same ``RANKWATCH_STANDIN_RENDEZVOUS`` directory and ``RANKWATCH_STANDIN_SESSION`` (from the job's
uid, a JobSet's for its child Jobs' pods, and the attempt: the pod's ``rankwatch.io/attempt``, a JobSet's
``restart-attempt``, and how often the group started anew here with none of its pods left running, as
an Indexed Job resumed after a suspend does), the local stand-ins for MASTER_ADDR:MASTER_PORT. A
deleted pod's processes are killed.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException

from rankwatch.cluster import ports

JOB_NAME_LABEL = "rankwatch.io/job-name"
ATTEMPT_LABEL = "rankwatch.io/attempt"
SIDECAR_ENDPOINT_ANNOTATION = "rankwatch.io/sidecar-endpoint"
TRACING_ANNOTATION = "rankwatch.io/tracing"
"""On a pod the admission webhook injected (an Indexed Job's, a JobSet's...): run it too."""
JOBSET_UID_LABEL = "jobset.sigs.k8s.io/jobset-uid"
JOBSET_RESTART_LABEL = "jobset.sigs.k8s.io/restart-attempt"
EXIT_CODE_ANNOTATION = "kwok.rankwatch.io/exit-code"
LIBRARY_IN_IMAGE = "/opt/rankwatch/lib/librankwatch-nccl.so"
SIDECAR_FLUSH_S = 8.0
POLL_S = 0.5

Log = Callable[[str], None]


def _field(pod: dict[str, Any], path: str) -> str:
    """A fieldRef's value: ``spec.nodeName``, or one key of a map, ``metadata.annotations['a/b']``."""
    key = None
    if path.endswith("']") and "['" in path:
        path, _, key = path[:-2].partition("['")
    value: Any = pod
    for part in path.split("."):
        value = (value or {}).get(part)
    if key is not None:
        value = (value or {}).get(key)
    return "" if value is None else str(value)


def _runs_here(pod: dict[str, Any]) -> bool:
    metadata = pod["metadata"]
    return (
        JOB_NAME_LABEL in (metadata.get("labels") or {})
        or (metadata.get("annotations") or {}).get(TRACING_ANNOTATION) == "enabled"
    )


def _group_uid(metadata: dict[str, Any]) -> str:
    """What a pod's group meets under: a JobSet's uid (its pods belong to several child Jobs), else its owner's."""
    jobset = (metadata.get("labels") or {}).get(JOBSET_UID_LABEL)
    return jobset or next((o["uid"] for o in metadata.get("ownerReferences") or []), metadata["uid"])


@dataclass
class RunningPod:
    uid: str
    namespace: str
    name: str
    root: Path
    group: str = ""
    trainer: subprocess.Popen | None = None
    sidecar: subprocess.Popen | None = None
    exit_code: int | None = None
    exited_at: float = 0.0
    reported: bool = False
    files: list[Any] = field(default_factory=list)

    def kill(self) -> None:
        self.signal_kill()
        for process in (self.trainer, self.sidecar):
            if process is not None:
                process.wait()
        for handle in self.files:
            handle.close()

    def signal_kill(self) -> None:
        """SIGKILL to the pod's process groups (its ranks too), without waiting: safe in a signal handler."""
        for process in (self.trainer, self.sidecar):
            if process is not None and process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)


class PodRunner:
    def __init__(
        self,
        collector_url: str,
        work_dir: Path,
        namespaces: list[str] | None = None,
        api_client: kubernetes.client.ApiClient | None = None,
        log: Log = print,
        also: Any = None,
    ) -> None:
        self.collector_url = collector_url
        self.work_dir = work_dir
        self.namespaces = namespaces or []
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.serializer = api_client or kubernetes.client.ApiClient()
        self.log = log
        self.pods: dict[str, RunningPod] = {}
        self.also = also  # a ServicePodRunner stepped in the same loop, or None
        self.ports_given: set[int] = set()  # a sidecar may not have bound its port yet: never give it twice
        self.starts: dict[str, int] = {}  # group uid -> times it started with none of its pods running here

    # -- the loop --------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    self.step()
                    if self.also is not None:
                        self.also.step()
                except ApiException as error:
                    self.log(f"pod runner: API error {error.status} {error.reason}; retrying")
                except urllib3.exceptions.HTTPError as error:  # the API server is away: keep the pods, as a kubelet
                    self.log(f"pod runner: API server unreachable ({type(error).__name__}); retrying")
                stop.wait(POLL_S)
        finally:
            for pod in self.pods.values():  # every pod signalled before any is waited for
                pod.signal_kill()
            for pod in self.pods.values():
                pod.kill()
            if self.also is not None:
                self.also.stop()

    def _list(self) -> list[dict[str, Any]]:
        """TrainingJob pods (by label) and pods of other kinds the webhook injected (by annotation, which no
        selector reaches: only in the namespaces named)."""
        if self.namespaces:
            items = [pod for namespace in self.namespaces for pod in self.core.list_namespaced_pod(namespace).items]
        else:
            items = self.core.list_pod_for_all_namespaces(label_selector=JOB_NAME_LABEL).items
        pods = [self.serializer.sanitize_for_serialization(pod) for pod in items]
        return [pod for pod in pods if _runs_here(pod)]

    def step(self) -> None:
        seen = set()
        for pod in self._list():
            metadata = pod["metadata"]
            uid = metadata["uid"]
            seen.add(uid)
            running = self.pods.get(uid)
            if metadata.get("deletionTimestamp"):
                if running:
                    running.kill()
                    del self.pods[uid]
                continue
            if running is None:
                if (pod.get("status") or {}).get("phase") == "Running" and (pod.get("spec") or {}).get("nodeName"):
                    self.pods[uid] = self._start(pod)
                continue
            self._follow(running)
        for uid in set(self.pods) - seen:
            self.pods.pop(uid).kill()

    def _follow(self, pod: RunningPod) -> None:
        if pod.trainer is not None and pod.exit_code is None and pod.trainer.poll() is not None:
            pod.exit_code, pod.exited_at = pod.trainer.returncode, time.monotonic()
            self.log(f"pod {pod.namespace}/{pod.name}: trainer exited with {pod.exit_code}")
        if pod.exit_code is not None and not pod.reported:
            code = pod.exit_code if pod.exit_code >= 0 else 128 - pod.exit_code
            self._annotate(pod.namespace, pod.name, {EXIT_CODE_ANNOTATION: str(code)})
            pod.reported = True
            if pod.sidecar is not None and pod.sidecar.poll() is None:
                pod.sidecar.send_signal(signal.SIGTERM)

    def _annotate(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        try:
            self.core.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": annotations}})
        except ApiException as error:
            if error.status != 404:
                raise

    # -- starting a pod ------------------------------------------------------------------------------
    def _start(self, pod: dict[str, Any]) -> RunningPod:
        metadata, spec = pod["metadata"], pod["spec"]
        namespace, name = metadata["namespace"], metadata["name"]
        root = self.work_dir / namespace / f"{name}-{metadata['uid'][:8]}"
        root.mkdir(parents=True, exist_ok=True)
        job_uid = _group_uid(metadata)
        if not any(other.group == job_uid for other in self.pods.values()):
            self.starts[job_uid] = self.starts.get(job_uid, -1) + 1
        running = RunningPod(metadata["uid"], namespace, name, root, job_uid)
        volumes = self._volumes(pod, root / "volumes")
        # Each attempt of a job meets afresh, as torchrun does at a new worker 0 after a restart.
        labels = metadata.get("labels") or {}
        attempt = "-".join(
            [labels.get(ATTEMPT_LABEL, "0")]
            + ([labels[JOBSET_RESTART_LABEL]] if JOBSET_RESTART_LABEL in labels else [])
            + ([f"s{self.starts[job_uid]}"] if self.starts[job_uid] else [])
        )
        rendezvous = self.work_dir / "rendezvous" / job_uid / attempt
        rendezvous.mkdir(parents=True, exist_ok=True)
        extra = {
            "RANKWATCH_STANDIN_RENDEZVOUS": str(rendezvous),
            "RANKWATCH_STANDIN_SESSION": f"{job_uid[:12]}-{attempt}",
            # which start of the group this is, for a stand-in fault of one attempt only (the container's
            # own RANKWATCH_ATTEMPT, a TrainingJob's, wins)
            "RANKWATCH_ATTEMPT": str(self.starts[job_uid]),
        }

        sidecar_port = None
        for container in spec.get("initContainers") or []:
            if container.get("restartPolicy") == "Always":
                sidecar_port = ports.free_port(avoid=self.ports_given)
                self.ports_given.add(sidecar_port)
                argv = self._argv(container, volumes)
                if argv[3:4] == ["sidecar"]:
                    argv += ["--host", "127.0.0.1", "--port", str(sidecar_port), "--collector-url", self.collector_url]
                running.sidecar = self._spawn(running, container, argv, self._env(pod, container, volumes, {}))
            else:
                self._init_container(container, volumes)
        if sidecar_port is not None:
            self._annotate(namespace, name, {SIDECAR_ENDPOINT_ANNOTATION: f"http://127.0.0.1:{sidecar_port}"})
        trainer = spec["containers"][0]
        running.trainer = self._spawn(
            running, trainer, self._argv(trainer, volumes), self._env(pod, trainer, volumes, extra)
        )
        self.log(f"pod {namespace}/{name} on {spec.get('nodeName')}: started (files in {root})")
        return running

    def _volumes(self, pod: dict[str, Any], root: Path) -> dict[str, Path]:
        paths = {}
        for volume in pod["spec"].get("volumes") or []:
            path = root / volume["name"]
            path.mkdir(parents=True, exist_ok=True)
            if "secret" in volume:
                secret = self.core.read_namespaced_secret(volume["secret"]["secretName"], pod["metadata"]["namespace"])
                for key, value in (secret.data or {}).items():
                    (path / key).write_bytes(base64.b64decode(value))
            paths[volume["name"]] = path
        return paths

    @staticmethod
    def _mounts(container: dict[str, Any], volumes: dict[str, Path]) -> list[tuple[str, str]]:
        """(mount path, local directory), longest mount path first (so prefixes resolve right)."""
        mounts = [(m["mountPath"].rstrip("/"), str(volumes[m["name"]])) for m in container.get("volumeMounts") or []]
        return sorted(mounts, key=lambda mount: -len(mount[0]))

    def _local(self, text: str, container: dict[str, Any], volumes: dict[str, Path]) -> str:
        for mount, local in self._mounts(container, volumes):
            text = text.replace(mount, local)
        return text

    def _argv(self, container: dict[str, Any], volumes: dict[str, Path]) -> list[str]:
        argv = [self._local(part, container, volumes) for part in (container.get("command") or []) + (
            container.get("args") or [])]  # fmt: skip
        if argv and argv[0] == "rankwatch":
            argv = [sys.executable, "-m", "rankwatch", *argv[1:]]
        return argv

    def _env(
        self, pod: dict[str, Any], container: dict[str, Any], volumes: dict[str, Path], extra: dict[str, str]
    ) -> dict[str, str]:
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": os.environ.get("HOME", "/tmp"),
            "PYTHONUNBUFFERED": "1",
            **(
                {"RANKWATCH_NATIVE_DIR": os.environ["RANKWATCH_NATIVE_DIR"]}
                if "RANKWATCH_NATIVE_DIR" in os.environ
                else {}
            ),
            **extra,
        }
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = self._local(str(item["value"]), container, volumes)
            elif "fieldRef" in (item.get("valueFrom") or {}):
                env[item["name"]] = _field(pod, item["valueFrom"]["fieldRef"]["fieldPath"])
        return env

    def _init_container(self, container: dict[str, Any], volumes: dict[str, Path]) -> None:
        command = container.get("command") or []
        if command[:2] == ["cp", LIBRARY_IN_IMAGE] and len(command) == 3:
            from rankwatch.standins.native import native_artifacts

            shutil.copy(native_artifacts().interposer, self._local(command[2], container, volumes))
        else:
            self.log(f"init container {container['name']}: not run (only rankwatch-init's copy is emulated)")

    def _spawn(self, pod: RunningPod, container: dict[str, Any], argv: list[str], env: dict[str, str]) -> Any:
        log = open(pod.root / f"{container['name']}.log", "ab")  # noqa: SIM115 (closed with the pod)
        pod.files.append(log)
        try:
            return subprocess.Popen(
                argv, env=env, cwd=pod.root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError as error:
            log.write(f"cannot start {argv}: {error}\n".encode())
            return subprocess.Popen(["sh", "-c", "exit 127"], start_new_session=True)


def run_pods(
    collector_url: str | None,
    namespaces: list[str],
    work_dir: Path,
    log: Log = print,
    collector_service: str | None = None,
) -> int:
    """`rankwatch cluster run-pods`: until SIGTERM / SIGINT; uses $KUBECONFIG. With ``collector_service``
    (``NAMESPACE/NAME``) rankwatch's own operator pods in ``namespaces`` run too (``service_pods.py``) and
    the sidecars reach that Service through a local proxy to its ready endpoints."""
    from rankwatch.cluster.service_pods import ServicePodRunner, ServiceProxy
    from rankwatch.kube import api_client

    api = api_client()
    stop = threading.Event()
    runner: PodRunner | None = None

    def stopping(*_: object) -> None:
        """The pods die at once, even while the loop waits for a slow API server: whoever stops the runner
        may kill it soon after, and a pod's processes live in sessions of their own (they would outlive it)."""
        stop.set()
        if runner is not None:
            for pod in list(runner.pods.values()):
                pod.signal_kill()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stopping)
    work_dir.mkdir(parents=True, exist_ok=True)
    services = ServicePodRunner(work_dir, namespaces, api, log=log) if collector_service else None
    if services is not None and collector_service is not None:
        namespace, _, name = collector_service.partition("/")
        collector_url = ServiceProxy(services, namespace, name, log=log).url
    if not collector_url:
        raise ValueError("give a collector URL or a collector Service")
    where = ", ".join(namespaces) or "all namespaces"
    log(f"pod runner: TrainingJob pods in {where}; collector {collector_url}; files in {work_dir}")
    runner = PodRunner(collector_url, work_dir, namespaces, api_client=api, log=log, also=services)
    runner.run(stop)
    return 0
