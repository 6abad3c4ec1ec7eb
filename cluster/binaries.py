"""Build the cluster binaries from their wrapper modules once, cache them by version, reuse them.

The cache lives outside the repository (``$RANKWATCH_CACHE_DIR``, default ``~/.cache/rankwatch``)
so that clean clones, CI runs and later sessions on the same machine reuse a build that costs tens
of minutes cold.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from rankwatch.cluster.versions import ADMISSION, COMPONENTS, MONITORING, TOOLS, Component

Log = Callable[[str], None]


class BuildError(RuntimeError):
    """A component could not be built; the message says which and how to retry."""


def cache_dir() -> Path:
    base = os.environ.get("RANKWATCH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rankwatch"
    )
    return Path(base)


def component_dir(component: Component) -> Path:
    return cache_dir() / "bin" / f"{component.name}-{component.version}"


def binary_path(name: str) -> Path:
    """Where the cached binary ``name`` is (built or not)."""
    for component in (*COMPONENTS, *TOOLS, *MONITORING, *ADMISSION):
        if name in component.packages:
            return component_dir(component) / name
    raise KeyError(f"no cluster component or tool provides a binary named {name!r}")


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    # Local toolchain only (no toolchain downloads), static binaries, reproducible paths.
    env.update(GOTOOLCHAIN="local", CGO_ENABLED="0", GOFLAGS="-mod=readonly -buildvcs=false")
    return env


def _build(component: Component, partial: Path, log: Log) -> None:
    if shutil.which("go") is None:
        raise BuildError("the Go toolchain is not on PATH; install Go >= 1.26 to build the local cluster")
    partial.mkdir(parents=True, exist_ok=True)
    ldflags = " ".join(("-s", "-w", *component.ldflags))
    for name, package in component.packages.items():
        if (partial / name).exists():
            continue  # survived an interrupted earlier build
        started = time.monotonic()
        log(f"building {name} {component.version} (first time only; this takes minutes)")
        result = subprocess.run(
            [
                "go",
                "build",
                "-trimpath",
                *(["-tags", ",".join(component.tags)] if component.tags else []),
                "-ldflags",
                ldflags,
                "-o",
                str(partial / f"{name}.tmp"),
                package,
            ],
            cwd=component.module_dir,
            env=_go_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if result.returncode != 0:
            tail = "\n".join(result.stdout.splitlines()[-30:])
            raise BuildError(f"go build {package} in {component.module_dir} failed:\n{tail}")
        (partial / f"{name}.tmp").rename(partial / name)
        log(f"built {name} in {time.monotonic() - started:.0f}s")


def ensure_component(component: Component, log: Log = print) -> Path:
    """Return the directory holding the component's binaries, building them if absent."""
    final = component_dir(component)
    if all((final / name).exists() for name in component.packages):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent `up` waits for this build instead of racing it
        if all((final / name).exists() for name in component.packages):
            return final
        partial = final.with_name(final.name + ".partial")
        _build(component, partial, log)
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
    return final


def ensure_tool(name: str, log: Log = print) -> Path:
    """Return the path of the tool binary ``name`` (``helm``, ``promtool``), building it if absent."""
    for component in TOOLS:
        if name in component.packages:
            return ensure_component(component, log) / name
    raise KeyError(f"no tool named {name!r}; known: {sorted(n for c in TOOLS for n in c.packages)}")


def ensure_all(log: Log = print, components: tuple[Component, ...] = COMPONENTS) -> dict[str, Path]:
    """Build every missing component (default: the cluster's); map each binary name to its path."""
    paths: dict[str, Path] = {}
    for component in components:
        directory = ensure_component(component, log)
        paths.update({name: directory / name for name in component.packages})
    return paths
