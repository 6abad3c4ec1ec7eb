"""Pinned versions of the local cluster's components and how each is built from its Go module."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GOMOD_ROOT = Path(__file__).parent / "gomod"

KUBERNETES_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.8"
KWOK_VERSION = "v0.8.0"
# Tools the chart and rules tests run (not part of the running cluster). Helm v3.22 builds with Go 1.26;
# Prometheus tags its Go module v0.3MM.P for release 3.MM.P: v0.315.0 is Prometheus 3.15.0 (v0.316.0
# needs a hashicorp/nomad/api pseudo-version the module proxy refuses to serve).
HELM_VERSION = "v3.22.0"
PROMETHEUS_MODULE_VERSION = "v0.315.0"
PROMETHEUS_VERSION = "3.15.0"
# The local monitoring stack (`rankwatch cluster up --monitoring`, the monitoring tests). Alertmanager
# v0.32 and later embed a web UI bundle (ui/app/dist) that their Go module does not ship, so they do
# not build from the module proxy; v0.31.1 is the newest release that does (its UI is committed Go).
ALERTMANAGER_VERSION = "v0.31.1"
# MinIO tags releases RELEASE.<date> (not semantic versions), so the module proxy serves it by
# pseudo-version only: this is the commit of 2026-02-12. The S3-compatible server of the archive tests.
MINIO_MODULE_VERSION = "v0.0.0-20260212201848-7aac2a2c5b7c"
# Kueue, the gang admission component of the queued-TrainingJob tests (`rankwatch cluster up --kueue`).
# v0.17.0 builds with Go 1.26 against Kubernetes 0.35 libraries (its own go.mod; no replace directives).
KUEUE_VERSION = "v0.17.0"
# The JobSet controller (its module root is `package main`), for the e2e tests of JobSet groups; v0.12
# builds against Kubernetes 0.36 libraries like the local cluster.
JOBSET_VERSION = "v0.12.0"
# Kubeflow Trainer v2 (TrainJob -> JobSet), for the e2e tests of TrainJob groups. v2.3.0 is the newest tag
# the module proxy serves (v2.4 and later: 403) and needs Go 1.26 and Kubernetes 0.36 libraries, as JobSet
# v0.12 does (it imports that JobSet's API).
TRAINER_VERSION = "v2.3.0"
# The Kubeflow training-operator v1 (PyTorchJob; Trainer v2 replaces it), for the e2e tests of PyTorchJob
# groups: v1.8.1 is the newest tag the module proxy serves; it builds with Go 1.26 against its own Kubernetes
# 0.29 libraries (4 min from an empty Go build cache on 2 busy cores, seconds once cached).
TRAINING_OPERATOR_VERSION = "v1.8.1"
# Volcano's Job CRD (from its module's manifests) for the tests of Volcano groups; its controller is not
# run (it needs Volcano's scheduler, queues and PodGroups): the tests make the pods as it would. v1.10.0 is
# the newest tag the module proxy serves (v1.11 and later: 403).
VOLCANO_MODULE_VERSION = "v1.10.0"


@dataclass(frozen=True)
class Component:
    """One wrapper module under cluster/gomod and the binaries built from it."""

    name: str
    version: str
    packages: dict[str, str]  # binary name -> Go package path
    ldflags: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()  # Go build tags

    @property
    def module_dir(self) -> Path:
        return GOMOD_ROOT / self.name


def _kubernetes_ldflags(version: str) -> tuple[str, ...]:
    # Without these the binaries report v0.0.0-master and version-skew checks misfire.
    major, minor = version.lstrip("v").split(".")[:2]
    prefix = "k8s.io/component-base/version"
    return (
        f"-X {prefix}.gitVersion={version}",
        f"-X {prefix}.gitMajor={major}",
        f"-X {prefix}.gitMinor={minor}",
        f"-X {prefix}.gitTreeState=clean",
    )


KUBERNETES = Component(
    name="kubernetes",
    version=KUBERNETES_VERSION,
    packages={
        name: f"k8s.io/kubernetes/cmd/{name}"
        for name in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
    },
    ldflags=_kubernetes_ldflags(KUBERNETES_VERSION),
)
ETCD = Component(name="etcd", version=ETCD_VERSION, packages={"etcd": "go.etcd.io/etcd/server/v3"})
KWOK = Component(name="kwok", version=KWOK_VERSION, packages={"kwok": "sigs.k8s.io/kwok/cmd/kwok"})

HELM = Component(
    name="helm",
    version=HELM_VERSION,
    packages={"helm": "helm.sh/helm/v3/cmd/helm"},
    # As helm's own Makefile does: its version, and the Kubernetes version `helm template`/`lint` assume
    # (client-go v0.37 -> 1.37); without them it says v3.22 and assumes Kubernetes 1.20.
    ldflags=(
        f"-X helm.sh/helm/v3/internal/version.version={HELM_VERSION}",
        *(f"-X helm.sh/helm/v3/pkg/{pkg}.k8sVersionMajor=1" for pkg in ("lint/rules", "chartutil")),
        *(f"-X helm.sh/helm/v3/pkg/{pkg}.k8sVersionMinor=37" for pkg in ("lint/rules", "chartutil")),
    ),
)
PROMTOOL = Component(
    name="promtool",
    version=PROMETHEUS_MODULE_VERSION,
    packages={"promtool": "github.com/prometheus/prometheus/cmd/promtool"},
    ldflags=(f"-X github.com/prometheus/common/version.Version={PROMETHEUS_VERSION}",),
    # promtool only checks and tests rules here: leave out the ~30 service-discovery plugins (cloud
    # SDKs), most of its build time. Prometheus' own build tag for this.
    tags=("remove_all_sd",),
)

PROMETHEUS = Component(
    name="prometheus",
    version=PROMETHEUS_MODULE_VERSION,
    packages={"prometheus": "github.com/prometheus/prometheus/cmd/prometheus"},
    ldflags=(f"-X github.com/prometheus/common/version.Version={PROMETHEUS_VERSION}",),
    # Scrape targets come from the local cluster's API server (pods, with the sidecar endpoint the pod
    # runner annotates) and from static configs: Kubernetes SD only, not the ~30 cloud ones. Without
    # `builtinassets` the web UI is not compiled in; the HTTP API, all the tests and the demo use, is.
    tags=("remove_all_sd", "enable_kubernetes_sd"),
)
ALERTMANAGER = Component(
    name="alertmanager",
    version=ALERTMANAGER_VERSION,
    packages={"alertmanager": "github.com/prometheus/alertmanager/cmd/alertmanager"},
    ldflags=(f"-X github.com/prometheus/common/version.Version={ALERTMANAGER_VERSION.lstrip('v')}",),
)

MINIO = Component(name="minio", version=MINIO_MODULE_VERSION, packages={"minio": "github.com/minio/minio"})
JOBSET = Component(name="jobset", version=JOBSET_VERSION, packages={"jobset-controller": "sigs.k8s.io/jobset"})
TRAINER = Component(
    name="trainer",
    version=TRAINER_VERSION,
    packages={"trainer-controller-manager": "github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager"},
)

TRAINING_OPERATOR = Component(
    name="training-operator",
    version=TRAINING_OPERATOR_VERSION,
    packages={"training-operator": "github.com/kubeflow/training-operator/cmd/training-operator.v1"},
)

KUEUE = Component(
    name="kueue",
    version=KUEUE_VERSION,
    packages={"kueue": "sigs.k8s.io/kueue/cmd/kueue"},
    ldflags=(f"-X sigs.k8s.io/kueue/pkg/version.GitVersion={KUEUE_VERSION}",),
)

COMPONENTS = (ETCD, KUBERNETES, KWOK)  # the local cluster (`rankwatch cluster up` builds these)
# built by `rankwatch cluster build --tools` / `make tools`
TOOLS = (HELM, PROMTOOL, MINIO, JOBSET, TRAINER, TRAINING_OPERATOR)
MONITORING = (PROMETHEUS, ALERTMANAGER)  # built by `rankwatch cluster build --monitoring` / `make monitoring`
ADMISSION = (KUEUE,)  # built by `rankwatch cluster build --kueue` / `make kueue`
