"""e2e harness: a real cluster (the built-in local one, or $KUBECONFIG's), the real operator, a
namespace per test.

- With ``RANKWATCH_USE_KUBECONFIG=1`` and ``KUBECONFIG`` pointing at a reachable cluster, that
  cluster is used as it is (opt-in, so a shell pointed at production never runs tests there).
- Otherwise a local cluster of the tests' own is brought up (state in ``$RANKWATCH_TEST_CLUSTER_DIR``,
  default ``~/.rankwatch/test-cluster``, apart from the one `make demo` uses; built on first use,
  reused when already up) and left running for the next run; ``RANKWATCH_E2E_CLUSTER_DOWN=1``
  removes it at the end.
The operator runs in-process with ``kopf.testing.KopfRunner``, watching only namespaces named
``rw-e2e-*``; tests that run their own operator use other names.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from kopf.testing import KopfRunner
from kubernetes.client.exceptions import ApiException

# the fixtures of the other kinds' tests (tests/support/other_kinds.py), for every e2e file that runs one
from other_kinds import (  # noqa: F401
    alert_sink,
    chart_rbac_kubeconfig,
    jobset_controller,
    volcano_commands,
    volcano_crd,
    watching,
    webhook,
)
from trainingjobs import crd_established

from rankwatch.cluster.operator_process import start_operator

REPO = Path(__file__).parents[2]
CRD_PATH = REPO / "crds" / "trainingjobs.rankwatch.io.yaml"
CHART = REPO / "helm" / "rankwatch"
E2E_NAMESPACE_PREFIX = "rw-e2e-"
# The pod runner's sidecars listen on 127.0.0.1 and say so in the pod annotation (kwok pod IPs are not
# real): every operator these tests start (in process or as a child, which inherits the environment)
# trusts that annotation for this host only.
os.environ.setdefault("RANKWATCH_SIDECAR_ENDPOINT_HOSTS", "127.0.0.1")


def _reachable(kubeconfig: str) -> bool:
    result = subprocess.run(
        ["kubectl", "--kubeconfig", kubeconfig, "get", "--raw", "/readyz"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    return result.returncode == 0


@pytest.fixture(scope="session")
def kubeconfig() -> Iterator[str]:
    external = os.environ.get("KUBECONFIG")
    if os.environ.get("RANKWATCH_USE_KUBECONFIG") == "1":
        if not (external and Path(external).exists() and _reachable(external)):
            pytest.exit(f"RANKWATCH_USE_KUBECONFIG=1 but KUBECONFIG={external!r} is not a reachable cluster", 2)
        yield external
        return
    from rankwatch.cluster.local import LocalCluster

    root = os.environ.get("RANKWATCH_TEST_CLUSTER_DIR") or os.path.expanduser("~/.rankwatch/test-cluster")
    cluster = LocalCluster(Path(root))
    cluster.up(log=lambda message: print(f"[cluster] {message}", flush=True))
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
    yield str(cluster.kubeconfig)
    if os.environ.get("RANKWATCH_E2E_CLUSTER_DOWN") == "1":
        cluster.down()


@pytest.fixture(scope="session")
def kubectl_path(kubeconfig: str) -> str:
    """The kubectl matching the local cluster's version when built, else the one on PATH."""
    from rankwatch.cluster.binaries import binary_path

    built = binary_path("kubectl")
    return str(built) if built.exists() else "kubectl"


@pytest.fixture(scope="session")
def kubectl(kubeconfig: str, kubectl_path: str) -> Callable[..., subprocess.CompletedProcess[str]]:
    def run(*args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [kubectl_path, "--kubeconfig", kubeconfig, *args],
            capture_output=True,
            text=True,
            input=input,
            timeout=60,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result

    return run


@pytest.fixture(scope="session")
def api(kubeconfig: str) -> kubernetes.client.ApiClient:
    return kubernetes.config.new_client_from_config(config_file=kubeconfig)


@pytest.fixture(scope="session")
def crd(kubectl: Callable[..., Any], api: kubernetes.client.ApiClient) -> None:
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_PATH))
    # its full pod template schema takes the API server a moment
    _eventually(lambda: crd_established(api, "trainingjobs.rankwatch.io"), 60, what="the CRD Established")


@pytest.fixture(scope="session")
def helm(kubeconfig: str, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., subprocess.CompletedProcess[str]]:
    from rankwatch.cluster.binaries import ensure_tool

    path = ensure_tool("helm")
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        "KUBECONFIG": kubeconfig,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
        "HOME": str(home),
        "PATH": "/usr/bin:/bin",
    }

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([str(path), *args], env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stderr}{result.stdout}"
        return result

    return run


def free_port() -> int:
    from rankwatch.cluster.ports import free_port as below_the_ephemeral_range

    return below_the_ephemeral_range()


@pytest.fixture(scope="session")
def collector_url() -> str:
    """Where the session operator's collector listens (loopback; sidecars of the pod runner post here)."""
    port = free_port()
    os.environ["RANKWATCH_COLLECTOR_LISTEN"] = f"127.0.0.1:{port}"
    return f"http://127.0.0.1:{port}"


def _chart_service_account_kubeconfig(admin_kubeconfig: str, kubectl: Callable[..., Any], directory: Path) -> str:
    """A kubeconfig holding a token of the Helm chart's operator ServiceAccount, bound to the chart's
    own RBAC (rendered for namespaces rw-e2e-*, as the session operator watches)."""
    from rankwatch.cluster.binaries import ensure_tool

    namespace, release = "rankwatch-e2e-system", "e2e"
    home = directory / "helm-home"
    rendered = subprocess.run(
        [
            str(ensure_tool("helm")),
            "template",
            release,
            str(REPO / "helm" / "rankwatch"),
            "--namespace",
            namespace,
            "--set",
            f"operator.namespaces={{{E2E_NAMESPACE_PREFIX}*}}",
            "--show-only",
            "templates/serviceaccount.yaml",
            "--show-only",
            "templates/rbac.yaml",
        ],
        env={
            "HOME": str(home),
            "HELM_CACHE_HOME": str(home),
            "HELM_CONFIG_HOME": str(home),
            "HELM_DATA_HOME": str(home),
        },
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    kubectl("create", "namespace", namespace, check=False)
    kubectl("apply", "-f", "-", input=rendered)
    account = f"{release}-rankwatch"
    api = kubernetes.config.new_client_from_config(config_file=admin_kubeconfig)
    token = (
        kubernetes.client.CoreV1Api(api)
        .create_namespaced_service_account_token(account, namespace, {"spec": {"expirationSeconds": 7200}})
        .status.token
    )
    admin = yaml.safe_load(Path(admin_kubeconfig).read_text())
    context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
    cluster = next(c for c in admin["clusters"] if c["name"] == context["cluster"])
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "operator",
        "clusters": [cluster],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": cluster["name"], "user": account}}],
    }
    path = directory / "operator-kubeconfig"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="session")
def operator(
    kubeconfig: str,
    crd: None,
    kubectl: Callable[..., Any],
    tmp_path_factory: pytest.TempPathFactory,
    collector_url: str,
) -> Iterator[KopfRunner]:
    """The real operator, in-process, for namespaces rw-e2e-*, its collector on ``collector_url``. With
    RANKWATCH_E2E_SERVICE_ACCOUNT=1 it runs as the Helm chart's ServiceAccount, so the e2e tests prove
    the chart's RBAC sufficient."""
    if os.environ.get("RANKWATCH_E2E_SERVICE_ACCOUNT") == "1":
        operator_kubeconfig = _chart_service_account_kubeconfig(kubeconfig, kubectl, tmp_path_factory.mktemp("sa"))
        # The handlers read $KUBECONFIG at startup; the tests' own clients keep the admin one explicitly.
        os.environ["KUBECONFIG"] = operator_kubeconfig
        kubeconfig = operator_kubeconfig
    kubernetes.config.load_kube_config(config_file=kubeconfig)
    # The operator reads its safeguards once, at start: cordons back to back (tests that cordon and undo
    # may land on the same node one after another, and several tests cordon at once).
    os.environ["RANKWATCH_CORDON_COOLDOWN_SECONDS"] = "0"
    os.environ["RANKWATCH_BREAKER_MAX_SHARE"] = "1"
    # The one S3 endpoint jobs may archive to: the recovery tests' MinIO, on a port chosen now.
    os.environ["RANKWATCH_ARCHIVE_ENDPOINTS"] = f"http://127.0.0.1:{free_port()}"
    args = ["run", "--standalone", "--namespace", f"{E2E_NAMESPACE_PREFIX}*", "-m", "rankwatch.operator.handlers"]
    with KopfRunner(args, timeout=60) as runner:
        yield runner
    assert runner.exception is None or isinstance(runner.exception, SystemExit), runner.output


def _new_namespace(api: kubernetes.client.ApiClient, prefix: str) -> str:
    name = f"{prefix}{uuid.uuid4().hex[:8]}"
    kubernetes.client.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
    return name


def _delete_namespace(api: kubernetes.client.ApiClient, name: str) -> None:
    try:
        kubernetes.client.CoreV1Api(api).delete_namespace(name)
    except ApiException as error:
        if error.status != 404:
            raise


@pytest.fixture
def namespace(api: kubernetes.client.ApiClient, operator: KopfRunner) -> Iterator[str]:
    """A fresh namespace that the session operator watches."""
    name = _new_namespace(api, E2E_NAMESPACE_PREFIX)
    yield name
    _delete_namespace(api, name)


@pytest.fixture
def unwatched_namespace(api: kubernetes.client.ApiClient, crd: None) -> Iterator[str]:
    """A fresh namespace no session operator watches (for tests that run their own)."""
    name = _new_namespace(api, "rw-own-")
    yield name
    _delete_namespace(api, name)


def _eventually(condition: Callable[[], Any], timeout: float = 60, interval: float = 0.5, what: str = "") -> Any:
    """Poll ``condition`` until it returns something truthy; fail with ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}; last value: {last!r}")


@pytest.fixture(scope="session")
def eventually() -> Callable[..., Any]:
    return _eventually


@pytest.fixture(scope="session")
def example_job() -> Callable[[], dict[str, Any]]:
    """A fresh copy of examples/trainingjob.yaml."""
    return lambda: yaml.safe_load((REPO / "examples" / "trainingjob.yaml").read_text())


def start_pod_runner(kubeconfig: str, collector_url: str, namespace: str, work_dir: Path) -> subprocess.Popen:
    """`rankwatch cluster run-pods` for one namespace: runs its worker pods as local processes."""
    work_dir.mkdir(parents=True, exist_ok=True)
    with open(work_dir / "pod-runner.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "rankwatch", "cluster", "run-pods", "--collector-url", collector_url,
             "--namespace", namespace, "--work-dir", str(work_dir)],
            env={**os.environ, "KUBECONFIG": kubeconfig},
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip


def stop_process(process: subprocess.Popen, timeout: float = 15) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def pod_runner(kubeconfig: str, collector_url: str, namespace: str, tmp_path: Path) -> Iterator[Path]:
    """The pod runner for this test's namespace, sending to the session operator; yields its work dir."""
    work_dir = tmp_path / "pods"
    process = start_pod_runner(kubeconfig, collector_url, namespace, work_dir)
    yield work_dir
    stop_process(process)


@pytest.fixture(scope="session")
def processes() -> Any:
    """Helpers for tests that run their own operator and pod runner processes."""
    import types

    return types.SimpleNamespace(
        free_port=free_port, operator=start_operator, pod_runner=start_pod_runner, stop=stop_process
    )
