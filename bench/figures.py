"""Headline figures as benches print them: one line each, ``FIGURE {json}``, beside the human-readable
table. ``bench/check_results.py`` reads these lines back and compares them with the figures published
in RESULTS.md's "Headline figures" table.

A figure that load moves (a time) is published with its ratio to a baseline measured in the same run
(reading the same bytes, the same call without the interposer), which a busy machine moves far less;
a figure load does not move (memory, bytes, a CPU share at a fixed rate) stands alone."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

PREFIX = "FIGURE "


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    unit: str
    baseline: float | None = None
    baseline_name: str = ""

    @property
    def ratio(self) -> float | None:
        return self.value / self.baseline if self.baseline else None


def emit(figure: Figure) -> None:
    record = {"name": figure.name, "value": figure.value, "unit": figure.unit}
    if figure.baseline is not None:
        record |= {"baseline": figure.baseline, "baseline_name": figure.baseline_name}
    print(PREFIX + json.dumps(record), flush=True)


def parse(text: str) -> dict[str, Figure]:
    """Every ``FIGURE`` line of a bench's output, by name (a later line of the same name wins)."""
    figures: dict[str, Figure] = {}
    for line in text.splitlines():
        if not line.startswith(PREFIX):
            continue
        record = json.loads(line[len(PREFIX) :])
        name = record["name"]
        if not re.fullmatch(r"[a-z0-9_.]+", name):
            raise ValueError(f"figure name {name!r}: lower-case letters, digits, '_' and '.' only")
        figures[name] = Figure(name, float(record["value"]), str(record["unit"]), record.get("baseline"),
                               record.get("baseline_name", ""))  # fmt: skip
    return figures
