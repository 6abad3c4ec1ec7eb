"""Pinned versions of the local cluster's components and how each is built from its Go module."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GOMOD_ROOT = Path(__file__).parent / "gomod"

KUBERNETES_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.8"
KWOK_VERSION = "v0.8.0"


@dataclass(frozen=True)
class Component:
    """One wrapper module under cluster/gomod and the binaries built from it."""

    name: str
    version: str
    packages: dict[str, str]  # binary name -> Go package path
    ldflags: tuple[str, ...] = ()

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

COMPONENTS = (ETCD, KUBERNETES, KWOK)
