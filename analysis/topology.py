"""Megatron's parallel layout: rank = tp + TP*(dp + DP*pp), and what a communicator is in it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml


class LayoutError(ValueError):
    """A layout that cannot describe the job; the message names the values."""


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    world_size: int

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1 or self.world_size < 1 or self.world_size % (self.tp * self.pp):
            raise LayoutError(f"TP {self.tp} x PP {self.pp} must divide world_size {self.world_size}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp, dp, pp) of a global rank."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def describe(self, rank: int) -> str:
        tp, dp, pp = self.coords(rank)
        return f"tp {tp}, dp {dp}, pp {pp}"

    def group_kind(self, members: set[int]) -> str:
        """TP, DP, PP, world or mixed, from which coordinates the members share."""
        if len(members) == self.world_size:
            return "world"
        tp, dp = self.tp, self.dp  # the coordinates inline: thousands of communicators at 16k ranks
        varying = [len({r % tp for r in members}) > 1, len({r // tp % dp for r in members}) > 1,
                   len({r // (tp * dp) for r in members}) > 1]  # fmt: skip
        names = {(True, False, False): "TP", (False, True, False): "DP", (False, False, True): "PP"}
        return names.get(tuple(varying), "mixed")  # type: ignore[arg-type]


def load_config(path: str | Path) -> Layout:
    """Megatrace's config.yaml: ``TP``, ``PP``, ``world_size``."""
    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise LayoutError(f"{path}: {error}") from error
    if not isinstance(config, dict):
        raise LayoutError(f"{path}: expected a mapping with TP, PP and world_size")
    missing = [key for key in ("TP", "PP", "world_size") if key not in config]
    if missing:
        raise LayoutError(f"{path}: missing {', '.join(missing)}")
    try:
        return Layout(int(config["TP"]), int(config["PP"]), int(config["world_size"]))
    except (TypeError, ValueError) as error:
        raise LayoutError(f"{path}: TP, PP and world_size must be integers ({error})") from error
