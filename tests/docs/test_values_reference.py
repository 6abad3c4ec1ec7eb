"""docs/values.md is the reference of the chart's values: every key of helm/rankwatch/values.yaml is
there, with the default the chart really has (a key added to the chart without a line here fails)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
VALUES = REPO / "helm" / "rankwatch" / "values.yaml"
REFERENCE = REPO / "docs" / "values.md"


def rows(text: str) -> dict[str, str]:
    """Key → its row's default cell, for every table row of the reference."""
    found = {}
    for line in text.splitlines():
        match = re.match(r"\|\s*`([^`]+)`\s*\|([^|]*)\|", line)
        if match:
            found[match[1]] = match[2].strip()
    return found


def leaves(node: Any, documented: dict[str, str], path: str = "") -> list[tuple[str, Any]]:
    """The keys a reader must find: the leaves, or a map documented as a whole (a row of its own)."""
    if path and "." in path and path in documented:
        return [(path, node)]
    if isinstance(node, dict) and node:
        return [leaf for key, value in node.items() for leaf in leaves(value, documented, f"{path}.{key}".strip("."))]
    return [(path, node)]


def every_path(node: Any, path: str = "") -> set[str]:
    inner = (
        {p for key, value in node.items() for p in every_path(value, f"{path}.{key}".strip("."))}
        if isinstance(node, dict)
        else set()
    )
    return inner | ({path} if path else set())


def test_every_key_of_the_chart_is_in_the_values_reference():
    documented = rows(REFERENCE.read_text())
    keys = leaves(yaml.safe_load(VALUES.read_text()), documented)
    missing = [path for path, _ in keys if path not in documented]
    assert not missing, f"docs/values.md has no row for: {missing}"
    unknown = sorted(set(documented) - every_path(yaml.safe_load(VALUES.read_text())))
    assert not unknown, f"docs/values.md documents keys the chart does not have: {unknown}"


def test_the_reference_gives_the_chart_defaults():
    documented = rows(REFERENCE.read_text())
    wrong = []
    for path, value in leaves(yaml.safe_load(VALUES.read_text()), documented):
        if isinstance(value, bool):
            expected = f"`{str(value).lower()}`"
        elif isinstance(value, int | float | str):
            expected = f"`{value}`" if value != "" else '`""`'
        elif value in ([], {}):
            expected = f"`{value}`"
        else:
            continue  # a map or list default is described in words
        if expected != documented[path] and not (isinstance(value, float) and documented[path].startswith(f"`{value}")):
            wrong.append(f"{path}: chart {expected}, reference {documented[path]}")
    assert not wrong, "\n".join(wrong)
