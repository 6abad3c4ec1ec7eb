"""What an analysis read against what the job had: the layout the traces record, the ranks without a
trace, the inputs that could not be read.

An analysis that did not see every rank cannot call a job healthy (the rank whose trace is missing may
be the one that stopped), and one that read nothing has nothing to say: both are *inconclusive*, and
say what is missing. The layout is read from the traces (ring headers, ``simulation.json`` beside the
rings of ``rankwatch simulate``, an archive's manifest) when not given, and checked against them when it is.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankwatch.analysis.topology import Layout, LayoutError
from rankwatch.analysis.trace import Trace

SIMULATION_FILE = "simulation.json"
SHOWN = 12  # ranks or inputs listed in a one-line reason; the JSON lists them all


@dataclass(frozen=True)
class GivenLayout:
    """A layout, or only a world size (``--world-size`` alone says nothing of TP and PP), and where it
    came from (``--world-size 16``, ``config.yaml``, ``the archive's manifest``)."""

    layout: Layout | None
    origin: str
    world_size: int = 0  # default: the layout's

    def __post_init__(self) -> None:
        if self.layout is not None:
            object.__setattr__(self, "world_size", self.layout.world_size)


def recorded_world_size(trace: Trace) -> int | None:
    """The world size the traces record (ring headers), None when they do not; headers that disagree
    are rings of more than one job, which no analysis can take as one."""
    sizes = Counter(source.world_size for source in trace.ranks.values() if source.world_size)
    if len(sizes) > 1:
        seen = ", ".join(f"{size} in {count} ring(s)" for size, count in sorted(sizes.items()))
        raise LayoutError(f"the ring headers disagree on the world size ({seen}): rings of more than one job?")
    return next(iter(sizes), None)


def simulation_layout(directory: Path) -> Layout | None:
    """The layout ``rankwatch simulate`` recorded beside its rings, when there is one."""
    path = directory / SIMULATION_FILE
    if not path.is_file():
        return None
    try:
        about = json.loads(path.read_text())["simulation"]
        return Layout(int(about["tp"]), int(about["pp"]), int(about["world_size"]))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise LayoutError(f"{path}: not a simulation record ({error})") from error


def resolve_layout(trace: Trace, directory: Path | None, given: GivenLayout | None) -> tuple[Layout | None, int | None]:
    """(the Megatron layout, the world size) for ``trace``: what was given, checked against what the traces
    record, else what they record. Raises :class:`LayoutError` naming both sides when they disagree."""
    recorded_world = recorded_world_size(trace)
    simulated = simulation_layout(directory) if directory else None
    if simulated and recorded_world and simulated.world_size != recorded_world:
        raise LayoutError(
            f"{SIMULATION_FILE} says world size {simulated.world_size} but the ring headers say {recorded_world}"
        )
    layout, world = simulated, simulated.world_size if simulated else recorded_world
    if given:
        if recorded_world and given.world_size != recorded_world:
            raise LayoutError(
                f"{given.origin} disagrees with the traces: their ring headers say world size {recorded_world}"
            )
        if simulated and given.world_size != simulated.world_size:
            raise LayoutError(
                f"{given.origin} disagrees with the traces: {SIMULATION_FILE} says world size {simulated.world_size}"
            )
        if simulated and given.layout and (given.layout.tp, given.layout.pp) != (simulated.tp, simulated.pp):
            raise LayoutError(
                f"{given.origin} disagrees with the traces: {SIMULATION_FILE} says TP {simulated.tp}, PP {simulated.pp}"
            )
        layout, world = given.layout or simulated, given.world_size
    if world and trace.ranks and max(trace.ranks) >= world:
        origin = given.origin if given else "the traces"
        raise LayoutError(f"the trace has rank {max(trace.ranks)} but {origin} gives world size {world}")
    return layout, world


@dataclass(frozen=True)
class Coverage:
    """How much of the job an analysis saw."""

    world_size: int | None  # the job's, when given or recorded
    ranks_read: int
    calls: int
    missing_ranks: tuple[int, ...]  # below the world size (or listed by a communicator), without a trace
    unseen_members: int  # members communicators count but whose traces are not there (ranks unknown)
    skipped: tuple[str, ...]  # inputs not read, each with its reason

    @property
    def nothing_read(self) -> bool:
        return self.ranks_read == 0 or self.calls == 0

    @property
    def inconclusive(self) -> bool:
        """Nothing read, a rank missing, or an input skipped that may have been a rank (world size unknown)."""
        return (
            self.nothing_read
            or bool(self.missing_ranks)
            or self.unseen_members > 0
            or (bool(self.skipped) and self.world_size is None)
        )

    def reason(self) -> str:
        """One line: why the analysis is inconclusive ('' when it is not)."""
        if not self.inconclusive:
            return ""
        parts = []
        if self.ranks_read == 0:
            parts.append("no trace could be read")
        elif self.calls == 0:
            parts.append(f"the traces of {self.ranks_read} rank(s) hold no NCCL call")
        if self.missing_ranks:
            noun = "rank" if len(self.missing_ranks) == 1 else "ranks"
            missing = f"{noun} {_listed(self.missing_ranks)}"
            if self.world_size:
                parts.append(f"{len(self.missing_ranks)} of {self.world_size} ranks have no trace ({missing})")
            else:
                parts.append(f"{len(self.missing_ranks)} member(s) of the communicators have no trace ({missing})")
        elif self.unseen_members:
            parts.append(f"communicators count {self.unseen_members} member(s) whose traces are not here")
        if self.skipped:
            parts.append(f"{len(self.skipped)} input(s) skipped ({_listed(self.skipped, '; ')})")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "ranks_read": self.ranks_read,
            "calls": self.calls,
            "missing_ranks": list(self.missing_ranks),
            "unseen_members": self.unseen_members,
            "skipped": list(self.skipped),
        }


def coverage(trace: Trace, world_size: int | None) -> Coverage:
    read = set(trace.ranks)
    missing = set(range(world_size)) - read if world_size else set()
    unseen = 0
    # Without a world size, communicators show ranks missing: members they list without a trace (a
    # flight-recorder dump's process groups name them), or more members counted than traced. With one,
    # the ranks below it say it all: a wrapped ring may no longer show which communicators its rank was in.
    for comm in trace.comms.values() if not world_size else ():
        members = set(comm.members.values())
        missing |= members - read
        unseen = max(unseen, comm.size - len(members))
    return Coverage(world_size, len(read), len(trace.calls), tuple(sorted(missing)), unseen, tuple(trace.skipped))


def _listed(items: tuple[Any, ...], separator: str = ", ") -> str:
    shown = separator.join(map(str, items[:SHOWN]))
    return shown + (f"{separator}... {len(items) - SHOWN} more" if len(items) > SHOWN else "")
