"""Paths and small helpers shared by the chart, rules and image tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO = Path(__file__).parents[2]
CHART = REPO / "helm" / "rankwatch"
RULES = CHART / "rules" / "rankwatch-rules.yaml"
KUBE_VERSION = "1.36.3"


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = [o for o in by_kind(objects, kind) if o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, found {[o['metadata']['name'] for o in found]}"
    return found[0]
