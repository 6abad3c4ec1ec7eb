"""The package's imports form layers: no module reaches, however lazily, a module that imports it back;
the finding model (`rankwatch.model`) imports nothing else of ours; the analysis (also run alone by
`rankwatch analyze`) imports nothing of the operator or the alerting; the alerting nothing of the
operator. Read from the source, so an import hidden in a function counts too; only
imports for type checking (never executed) are left out."""

from __future__ import annotations

import ast
import functools
import tomllib
from collections.abc import Mapping, Set
from pathlib import Path

ROOT = Path(__file__).parents[2]


def modules() -> dict[str, Path]:
    """Every module of the installed packages, by dotted name (as pyproject maps the folders)."""
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found: dict[str, Path] = {}
    for package, folder in package_dirs.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [part for part in path.relative_to(ROOT / folder).with_suffix("").parts if part != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    skipped: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(ast.walk(child))
    return skipped


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports (``from package import submodule`` is the submodule)."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            submodules = {f"{module}.{alias.name}" for alias in node.names} & known.keys()
            found.update(submodules or {module})
    return {module for module in found if module in known and module != name}


def cycles(graph: Mapping[str, Set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


@functools.cache
def graph() -> dict[str, frozenset[str]]:
    """Read once per session (every module parsed twice over took seconds a test): the tests only read it."""
    known = modules()
    return {name: frozenset(imports_of(name, path, known)) for name, path in known.items()}


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(graph()) == []


def test_the_analysis_imports_nothing_of_the_operator_or_the_alerting():
    upward = {
        name: sorted(target for target in targets if target.startswith(("rankwatch.operator", "rankwatch.alerting")))
        for name, targets in graph().items()
        if name.startswith("rankwatch.analysis")
    }
    assert {name: targets for name, targets in upward.items() if targets} == {}


def test_the_finding_model_imports_nothing_else_of_ours():
    """``rankwatch.model`` is the bottom: every stage speaks it, so it may lean on none of them."""
    outside = {
        name: sorted(target for target in targets if not target.startswith("rankwatch.model"))
        for name, targets in graph().items()
        if name.startswith("rankwatch.model")
    }
    assert outside and {name: targets for name, targets in outside.items() if targets} == {}


def test_the_alerting_imports_nothing_of_the_operator():
    """Alerting renders findings (the model); the operator calls it, never the other way round."""
    upward = {
        name: sorted(target for target in targets if target.startswith("rankwatch.operator"))
        for name, targets in graph().items()
        if name.startswith("rankwatch.alerting")
    }
    assert {name: targets for name, targets in upward.items() if targets} == {}


def test_the_walk_sees_a_cycle_hidden_in_a_function(tmp_path):
    """The check itself: a lazy import back is a cycle, a type-checking import is not."""
    (tmp_path / "a.py").write_text("def f():\n    from pkg import b\n")
    (tmp_path / "b.py").write_text("from pkg.a import f\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    known = {f"pkg.{name}": tmp_path / f"{name}.py" for name in "abc"}
    found = {name: imports_of(name, path, known) for name, path in known.items()}
    assert found == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": set()}
    assert cycles(found) == [["pkg.a", "pkg.b"]]


IMPORT_EVERYTHING = """
import importlib, json, pkgutil
from prometheus_client import REGISTRY

def names():
    return {family.name for family in REGISTRY.collect()}

before = names()
imported = 0
for package in PACKAGES:
    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
            imported += 1
print(json.dumps({"imported": imported, "registered": sorted(names() - before)}))
"""


def test_importing_every_module_registers_no_metric():
    """Metrics are made when the operator starts and passed in (``OperatorMetrics``): a module that
    registered one at import would clash with a second registry user and hide who counts what."""
    import json
    import subprocess
    import sys

    packages = sorted(name for name, path in modules().items() if name.count(".") <= 1 and path.name == "__init__.py")
    code = f"PACKAGES = {packages!r}\n" + IMPORT_EVERYTHING
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["imported"] > 100
    assert result["registered"] == []


RUNTIME_PACKAGES = ("rankwatch.operator", "rankwatch.sidecar", "rankwatch.alerting", "rankwatch.analysis")


def test_no_runtime_package_imports_the_stand_ins():
    """The runtime image leaves ``rankwatch.standins`` out by folder: an import of it from what the operator,
    the sidecar or the alerting runs would fail there, however lazily it was written."""
    reaching = {
        name: sorted(target for target in targets if target.startswith("rankwatch.standins"))
        for name, targets in graph().items()
        if name.startswith(RUNTIME_PACKAGES)
    }
    assert {name: targets for name, targets in reaching.items() if targets} == {}


def test_the_configuration_is_a_leaf_that_imports_no_implementation():
    """``operator/config.py`` holds every component's settings (the collector's, the breaker's, the
    safeguards, the node-alert sources) and the components import it, never the reverse: what it imports
    for parsing (the error type, the API timeout, the event-loop and archive-endpoint checks) imports
    nothing of rankwatch in turn, so reading the configuration loads no collector, monitor or cordon code."""
    imports = graph()
    config = imports["rankwatch.operator.config"]
    assert {name: sorted(imports[name]) for name in config if imports[name]} == {}
    assert not {
        name for name in config if name.startswith(("rankwatch.operator.diagnosis", "rankwatch.operator.remediation"))
    }


DIAGNOSIS = "rankwatch.operator.diagnosis"
ROOMS = ("ingest", "detect", "diagnose", "report")
"""The diagnosis's rooms in the order a finding passes them; each imports only the rooms before it."""


def test_the_diagnosis_rooms_depend_only_on_earlier_stages():
    """Ingest knows nothing of detection, detection nothing of diagnosis, diagnosis nothing of the
    report; none reaches the monitor, the hub that calls them all (``metrics``, counted by every stage,
    imports nothing of ours)."""
    imports = graph()
    assert {f"{DIAGNOSIS}.{room}" for room in ROOMS} <= imports.keys()
    backward = {}
    for name, targets in imports.items():
        if not name.startswith(f"{DIAGNOSIS}."):
            continue
        room = name.split(".")[3]
        if room not in ROOMS:
            continue
        allowed = {f"{DIAGNOSIS}.{earlier}" for earlier in ROOMS[: ROOMS.index(room) + 1]} | {f"{DIAGNOSIS}.metrics"}
        wrong = sorted(
            target
            for target in targets
            if target.startswith(f"{DIAGNOSIS}.") and not any(target.startswith(ok) for ok in allowed)
        )
        if wrong:
            backward[name] = wrong
    assert backward == {}
    assert imports[f"{DIAGNOSIS}.metrics"] == set()
