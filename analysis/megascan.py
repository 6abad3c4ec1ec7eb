"""MegaScan's traces (MegatronApp's tracer, first published as DT-Tracer) into a Trace, and back.

MegaScan records CUDA events around scopes of Megatron's training step and writes, per rank, a JSON
list ``benchmark-data-<dp>-pipeline-<pp>-tensor-<tp>.json`` (rank 0 gathers and writes them all):

- ``{"name": "iteration", "ph": "B", "pad_before": ns}`` opens an iteration (``pad_before``: wall
  time since the previous one ended); ``{"name": "iteration", "ph": "E", "rel_ts", "duration_cuda",
  "duration_wall"}`` closes it. Records outside an iteration (evaluation) are not part of training.
- between them ``{"name", "ph": "B"|"E", "rel_ts"}`` scopes, nested, ``rel_ts`` in ns from the
  iteration's CUDA start event: ``forward`` / ``backward`` of one microbatch and model chunk (the
  ``E`` carries ``microbatch``, ``model_chunk``, ``pp_rank``); with ``--trace-granularity full``
  (newer versions: also ``base``) communication: ``_reduce``, ``_gather_along_*``,
  ``_reduce_scatter_along_*`` (tensor parallel), ``send-*`` / ``recv-*`` / ``exchange-*`` (pipeline,
  with ``data`` bytes), ``allreduce`` / ``grad-sync`` (data parallel); newer versions add ``dp_rk``,
  ``pp_rk``, ``tp_rk``, ``g_rk`` to every record.

Its aggregator merges them into one Chrome trace (a JSON list, ``ts`` in µs on one timeline, ``pid``
per rank, ``args.iteration``; ``B``/``E`` pairs, or ``X`` slices with ``dur`` and ``M`` records
naming each process ``DP<d>-PP<p>-TP<t>``; some published files add ``iteration begin`` / ``end``
instants). Older aggregates number ``pid`` = tp + TP·(pp + PP·dp) and name the run
``data-<D>-pipeline-<P>-tensor-<T>-...json``.

Forward/backward scopes become compute spans (``Trace.spans``), iterations ``Trace.iterations``;
communication scopes become GPU-timed calls on the layout's TP, DP and pipeline groups, so the
detectors of every other format read them. Untrusted input: a file that is not such a trace is a
``problems`` line naming it and what is wrong; the other ranks are still read.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rankwatch.analysis.flight_recorder import _number_p2p_per_peer
from rankwatch.analysis.ring import MAX_GLOBAL_RANK, Op
from rankwatch.analysis.topology import Layout, LayoutError
from rankwatch.analysis.trace import (
    BACKWARD,
    CALL_DTYPE,
    FORWARD,
    ITERATION_DTYPE,
    P2P_OPS,
    SPAN_DTYPE,
    Communicator,
    RankSource,
    Trace,
)

PER_RANK = re.compile(r"^benchmark-data-(\d+)-pipeline-(\d+)-tensor-(\d+)\.json$")
RUN_SIZES = re.compile(r"data-(\d+)-pipeline-(\d+)-tensor-(\d+)")
PROCESS_NAME = re.compile(r"^DP(\d+)-PP(\d+)-TP(\d+)$")
MAX_FILE_BYTES = 1 << 30
BASE_NS = 10**9  # each rank's timeline starts here (a call time of 0 means "never")
SPAN_KINDS = {"forward": FORWARD, "backward": BACKWARD}
# communication scopes: (op, group kind); a pipeline scope: [(op, +1 next stage / -1 previous)]
COLLECTIVES = {
    "_reduce": (Op.ALLREDUCE, "tp"), "_gather_along_last_dim": (Op.ALLGATHER, "tp"),
    "_gather_along_first_dim": (Op.ALLGATHER, "tp"), "_reduce_scatter_along_last_dim": (Op.REDUCESCATTER, "tp"),
    "_reduce_scatter_along_first_dim": (Op.REDUCESCATTER, "tp"), "allreduce": (Op.ALLREDUCE, "dp"),
    "grad-sync": (Op.ALLREDUCE, "dp"),
}  # fmt: skip
PIPELINE = {
    "send-forward": [(Op.SEND, 1)], "recv-forward": [(Op.RECV, -1)], "send-backward": [(Op.SEND, -1)],
    "recv-backward": [(Op.RECV, 1)], "send-warmup": [(Op.SEND, 1)], "recv-warmup": [(Op.RECV, -1)],
    "send-cooldown": [(Op.SEND, -1)], "recv-cooldown": [(Op.RECV, 1)],
    "exchange-next": [(Op.SEND, 1), (Op.RECV, 1)], "exchange-prev": [(Op.SEND, -1), (Op.RECV, -1)],
}  # fmt: skip


TP_SCOPES = {Op.ALLREDUCE: "_reduce", Op.ALLGATHER: "_gather_along_first_dim",
             Op.REDUCESCATTER: "_reduce_scatter_along_first_dim"}  # fmt: skip


class MegaScanError(ValueError):
    """A MegaScan trace rankwatch cannot read; the message names the file and what is wrong."""


@dataclass
class _RankRead:
    """One rank's scopes, on its own timeline (ns from BASE_NS)."""

    coords: tuple[int, int, int]  # (dp, pp, tp)
    global_rank: int | None  # g_rk when the records carry it
    path: str
    spans: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)  # iter, kind, mb, chunk, s, e
    iterations: list[tuple[int, int, int, int]] = field(default_factory=list)  # iter, start, cuda, wall
    comms: list[tuple[str, int, int, int]] = field(default_factory=list)  # name, start, end, bytes
    unmapped: dict[str, int] = field(default_factory=dict)  # scope name -> count (not analysed)
    outside: int = 0  # records outside any iteration (evaluation)


def megascan_files(directory: Path) -> list[Path]:
    """The per-rank traces in ``directory``; else its aggregated traces (JSON lists of Chrome-trace events)."""
    per_rank = sorted(p for p in directory.iterdir() if p.is_file() and PER_RANK.match(p.name))
    if per_rank:
        return per_rank
    return sorted(p for p in directory.glob("*.json") if p.is_file() and _looks_aggregated(p))


def _looks_aggregated(path: Path) -> bool:
    with open(path, "rb") as handle:
        head = handle.read(4096)
    return head.lstrip()[:1] in (b"[", b"{") and b'"ph"' in head and b'"ts"' in head and b'"pid"' in head


def _load(path: Path) -> Any:
    with open(path, "rb") as handle:
        data = handle.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise MegaScanError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB: not a MegaScan trace")
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        where = f"line {error.lineno}: " if isinstance(error, json.JSONDecodeError) else ""
        raise MegaScanError(f"{path}: {where}not valid JSON: {error}") from error
    except RecursionError as error:
        raise MegaScanError(f"{path}: nested too deeply: not a MegaScan trace") from error


def _number(record: dict[str, Any], key: str, path: Path, index: int, default: int | None = None) -> int:
    value = record.get(key, default)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise MegaScanError(f"{path}: record {index} ({record.get('name')!r}): {key} {value!r} is not a number")
    if abs(value) > 1 << 62:
        raise MegaScanError(f"{path}: record {index}: {key} {value!r} is out of range")
    return int(value)


def _nanoseconds(event: dict[str, Any], key: str, path: Path, index: int) -> int:
    """A Chrome-trace time (µs, possibly fractional) in ns."""
    _number(event, key, path, index)
    return round(float(event[key]) * 1000)


def _small(record: dict[str, Any], key: str, path: Path, index: int) -> int:
    """A coordinate or index: a non-negative integer no larger than a global rank can be."""
    value = _number(record, key, path, index)
    if not 0 <= value <= MAX_GLOBAL_RANK:
        raise MegaScanError(f"{path}: record {index}: {key} {value} is outside 0..{MAX_GLOBAL_RANK}")
    return value


def _read_rank_file(path: Path, coords: tuple[int, int, int]) -> _RankRead:
    records = _load(path)
    if not isinstance(records, list):
        raise MegaScanError(f"{path}: expected a JSON list of MegaScan records, got {type(records).__name__}")
    read = _RankRead(coords, None, str(path))
    timeline = BASE_NS
    iteration: int | None = None
    open_scopes: list[tuple[str, int]] = []
    pad = 0
    for index, record in enumerate(records):
        if not isinstance(record, dict) or not isinstance(record.get("name"), str) or record.get("ph") not in (
            "B", "E", "i", "X",
        ):  # fmt: skip
            raise MegaScanError(f"{path}: record {index} is not a MegaScan record (a name and ph B, E or i)")
        name, phase = record["name"], record["ph"]
        if "g_rk" in record and read.global_rank is None:
            read.global_rank = _small(record, "g_rk", path, index)
        if name == "iteration" and phase == "B":
            if iteration is not None:
                raise MegaScanError(f"{path}: record {index}: an iteration begins inside iteration {iteration}")
            iteration, open_scopes = len(read.iterations), []
            pad = max(_number(record, "pad_before", path, index, 0), 0)
            timeline += pad
            continue
        if iteration is None:
            read.outside += 1
            continue
        if name == "iteration" and phase == "E":
            if open_scopes:
                raise MegaScanError(f"{path}: record {index}: iteration {iteration} ends inside {open_scopes[-1][0]!r}")
            cuda = max(_number(record, "duration_cuda", path, index, 0), 0)
            wall = max(_number(record, "duration_wall", path, index, 0), 0)
            read.iterations.append((iteration, timeline, cuda, wall))
            timeline += wall or cuda
            iteration = None
            continue
        if phase not in ("B", "E"):
            continue  # instants
        at = timeline + _number(record, "rel_ts", path, index)
        if phase == "B":
            open_scopes.append((name, at))
            continue
        if not open_scopes or open_scopes[-1][0] != name:
            opened = repr(open_scopes[-1][0]) if open_scopes else "nothing"
            raise MegaScanError(f"{path}: record {index}: the end of {name!r} closes {opened}")
        _, start = open_scopes.pop()
        _scope(read, name, record, iteration, start, at, path, index)
    if iteration is not None:
        read.unmapped["(the last iteration, unfinished)"] = 1
    return read


def _scope(read: _RankRead, name: str, attrs: dict, iteration: int, start: int, end: int, path: Path, index: int):
    if end < start:
        raise MegaScanError(f"{path}: record {index}: {name!r} ends {start - end} ns before it begins")
    if name in SPAN_KINDS:
        microbatch = _small(attrs, "microbatch", path, index) if "microbatch" in attrs else -1
        chunk = _small(attrs, "model_chunk", path, index) if "model_chunk" in attrs else 0
        read.spans.append((iteration, SPAN_KINDS[name], microbatch, chunk, start, end))
    elif name in COLLECTIVES or name in PIPELINE:
        data = attrs.get("data")
        size = int(data) if isinstance(data, (int, float)) and not isinstance(data, bool) and 0 <= data < 1 << 62 else 0
        read.comms.append((name, start, end, size))
    else:
        read.unmapped[name] = read.unmapped.get(name, 0) + 1


def _read_aggregated(path: Path, layout: Layout | None) -> list[_RankRead]:
    """The ranks of one aggregated Chrome trace."""
    document = _load(path)
    events = document.get("traceEvents") if isinstance(document, dict) else document
    if not isinstance(events, list):
        raise MegaScanError(f"{path}: expected a JSON list of Chrome-trace events (or traceEvents)")
    coords: dict[int, tuple[int, int, int]] = {}
    ranks: dict[int, int] = {}
    tids: dict[int, set] = {}
    for index, event in enumerate(events):
        if not isinstance(event, dict) or not isinstance(event.get("name"), str) or "ph" not in event:
            raise MegaScanError(f"{path}: event {index} is not a Chrome-trace event (a name and a ph)")
        args = event.get("args") if isinstance(event.get("args"), dict) else {}
        pid = _small(event, "pid", path, index)
        tids.setdefault(pid, set()).add(repr(event.get("tid", 0)))
        if event["ph"] == "M" and event["name"] == "process_name" and isinstance(args.get("name"), str):
            if match := PROCESS_NAME.match(args["name"]):
                coords[pid] = (int(match.group(1)), int(match.group(2)), int(match.group(3)))
        elif all(key in args for key in ("dp_rk", "pp_rk", "tp_rk")):
            coords[pid] = tuple(_small(args, key, path, index) for key in ("dp_rk", "pp_rk", "tp_rk"))  # type: ignore[assignment]
            if "g_rk" in args:
                ranks[pid] = _small(args, "g_rk", path, index)
    several = sorted(pid for pid, seen in tids.items() if len(seen) > 1)
    if several:
        raise MegaScanError(f"{path}: process {several[0]} has events on several threads: not one MegaScan run")
    sizes = RUN_SIZES.search(path.name)
    for pid in tids.keys() - coords.keys():
        if layout is not None:  # the pid is the global rank
            tp, dp, pp = layout.coords(pid)
            coords[pid], ranks[pid] = (dp, pp, tp), pid
        elif sizes and min(int(size) for size in sizes.groups()) >= 1:  # older aggregates: pid = tp + TP*(pp + PP*dp)
            _, pipeline, tensor = (int(size) for size in sizes.groups())
            coords[pid] = (pid // (pipeline * tensor), (pid // tensor) % pipeline, pid % tensor)
        else:
            raise MegaScanError(
                f"{path}: cannot tell which rank process {pid} is: its events carry no dp_rk/pp_rk/tp_rk, there "
                "is no DP<d>-PP<p>-TP<t> process name, and the file is not named data-<D>-pipeline-<P>-tensor-<T>"
                "...; give the layout (--tp --pp --world-size)"
            )
    reads = {pid: _RankRead(coords[pid], ranks.get(pid), str(path)) for pid in tids}
    open_scopes: dict[int, list[tuple[str, int]]] = {pid: [] for pid in tids}
    bounds: dict[tuple[int, int], list[int]] = {}  # (pid, iteration) -> [begin, end] from instants
    windows: dict[tuple[int, int], list[int]] = {}  # (pid, iteration) -> first and last time of its scopes
    for index, event in enumerate(events):
        phase, name = event["ph"], event["name"]
        if phase == "M":
            continue
        args = event.get("args") if isinstance(event.get("args"), dict) else {}
        pid = int(event["pid"])
        at = BASE_NS + _nanoseconds(event, "ts", path, index)
        if "iteration" not in args:
            raise MegaScanError(f"{path}: event {index} ({name!r}) has no args.iteration")
        iteration = _small(args, "iteration", path, index)
        if phase == "i":
            if name in ("iteration begin", "iteration end"):
                bounds.setdefault((pid, iteration), [0, 0])[name == "iteration end"] = at
            continue
        if phase == "B":
            open_scopes[pid].append((name, at))
            continue
        if phase == "X":
            start, end = at, at + _nanoseconds(event, "dur", path, index)
        elif phase == "E":
            if not open_scopes[pid] or open_scopes[pid][-1][0] != name:
                opened = repr(open_scopes[pid][-1][0]) if open_scopes[pid] else "nothing"
                raise MegaScanError(f"{path}: event {index}: the end of {name!r} on process {pid} closes {opened}")
            start, end = open_scopes[pid].pop()[1], at
        else:
            continue
        window = windows.setdefault((pid, iteration), [start, end])
        window[0], window[1] = min(window[0], start), max(window[1], end)
        _scope(reads[pid], name, args, iteration, start, end, path, index)
    for (pid, iteration), (start, end) in sorted(windows.items()):
        begin, finish = bounds.get((pid, iteration), (0, 0))
        if begin and finish > begin:
            start, end = begin, finish
        reads[pid].iterations.append((iteration, start, end - start, 0))
    return [reads[pid] for pid in sorted(reads)]


def _group_id(kind: str, key: tuple[int, ...]) -> int:
    digest = hashlib.blake2b(f"megascan {kind} {key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class _Groups:
    """The layout's TP, DP and pipeline groups: id, size, members, and where each rank sits in them."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.comms: dict[int, Communicator] = {}

    def rank(self, dp: int, pp: int, tp: int) -> int:
        return tp + self.layout.tp * (dp + self.layout.dp * pp)

    def of(self, kind: str, coords: tuple[int, int, int]) -> tuple[int, int, int] | None:
        """(communicator id, rank in it, size) of ``kind`` for the rank at ``coords``, or None (size 1)."""
        dp, pp, tp = coords
        sizes = {"tp": self.layout.tp, "dp": self.layout.dp, "pp": self.layout.pp}
        if sizes[kind] < 2:
            return None
        key, position = {"tp": ((dp, pp), tp), "dp": ((tp, pp), dp), "pp": ((tp, dp), pp)}[kind]
        comm_id = _group_id(kind, key)
        if comm_id not in self.comms:
            members = {
                "tp": [self.rank(dp, pp, t) for t in range(self.layout.tp)],
                "dp": [self.rank(d, pp, tp) for d in range(self.layout.dp)],
                "pp": [self.rank(dp, p, tp) for p in range(self.layout.pp)],
            }[kind]
            self.comms[comm_id] = Communicator(comm_id, len(members), dict(enumerate(members)))
        return comm_id, position, sizes[kind]


def _spans(rank: int, read: _RankRead) -> np.ndarray:
    """The rank's spans, each with the time of the communication scopes recorded inside it."""
    spans = np.zeros(len(read.spans), SPAN_DTYPE)
    if not len(spans):
        return spans
    columns = np.array(read.spans, np.int64).reshape(-1, 6)
    spans["rank"] = rank
    for index, name in enumerate(("iteration", "kind", "microbatch", "chunk", "start", "end")):
        spans[name] = columns[:, index]
    if read.comms:
        comms = np.array([(start, end) for _, start, end, _ in read.comms], np.int64)
        order = np.argsort(spans["start"], kind="stable")
        inside = np.searchsorted(spans["start"][order], comms[:, 0], "right") - 1
        held = (inside >= 0) & (comms[:, 1] <= spans["end"][order][np.maximum(inside, 0)])
        np.add.at(spans["comm_ns"], order[inside[held]], comms[held, 1] - comms[held, 0])
    return spans


def _calls(reads: list[tuple[int, _RankRead]], groups: _Groups) -> np.ndarray:
    rows = []
    for rank, read in reads:
        counters: dict[int, int] = {}
        for name, start, end, size in sorted(read.comms, key=lambda comm: comm[1]):
            if name in COLLECTIVES:
                op, kind = COLLECTIVES[name]
                where = groups.of(kind, read.coords)
                if where is None:
                    continue
                comm_id, position, members = where
                counters[comm_id] = counters.get(comm_id, 0) + 1
                rows.append((rank, comm_id, counters[comm_id], op, size, 0, -1, position, members,
                             start, end, start, end, 0))  # fmt: skip
                continue
            where = groups.of("pp", read.coords)
            if where is None:
                continue
            comm_id, stage, members = where
            for op, step in PIPELINE[name]:
                if 0 <= stage + step < members:
                    rows.append((rank, comm_id, 0, op, size, 0, stage + step, stage, members,
                                 start, end, start, end, 0))  # fmt: skip
    calls = np.array(rows, CALL_DTYPE) if rows else np.zeros(0, CALL_DTYPE)
    return calls


def read_traces(path: str | Path, layout: Layout | None = None) -> Trace:
    """A directory of per-rank MegaScan traces (or of one aggregated trace), or one aggregated file.
    ``layout``: the job's Megatron layout; by default the one the file names give."""
    path = Path(path)
    files = megascan_files(path) if path.is_dir() else [path]
    problems: list[str] = []
    skipped: list[str] = []  # inputs not read (an analysis without them is inconclusive)
    reads: list[_RankRead] = []
    per_rank = [(f, PER_RANK.match(f.name)) for f in files]
    if all(match for _, match in per_rank):
        for file, match in per_rank:
            dp, pp, tp = (int(value) for value in match.groups())  # type: ignore[union-attr]
            try:
                reads.append(_read_rank_file(file, (dp, pp, tp)))
            except (MegaScanError, OSError) as error:
                problems.append(str(error) if str(file) in str(error) else f"{file}: {error}")
                skipped.append(problems[-1])
    else:
        if len(files) > 1:
            names = ", ".join(f.name for f in files)
            raise MegaScanError(f"{path}: several MegaScan aggregated traces ({names}): give one file")
        try:
            reads = _read_aggregated(files[0], layout)
        except OSError as error:
            raise MegaScanError(f"{files[0]}: {error}") from error
    if not reads:
        raise MegaScanError(f"{path}: no MegaScan trace could be read: " + "; ".join(problems))
    trace = _assemble(reads, layout, problems)
    trace.skipped = skipped
    return trace


def _assemble(reads: list[_RankRead], layout: Layout | None, problems: list[str]) -> Trace:
    if layout is None:
        dp, pp, tp = (max(read.coords[axis] for read in reads) + 1 for axis in range(3))
        try:
            layout = Layout(tp, pp, tp * pp * dp)
        except LayoutError as error:
            raise MegaScanError(f"the traces' coordinates give no layout: {error}") from error
    if layout.world_size > MAX_GLOBAL_RANK + 1:
        raise MegaScanError(
            f"the traces' coordinates make a world of {layout.world_size} ranks, more than rankwatch reads"
        )
    groups = _Groups(layout)
    ranked: list[tuple[int, _RankRead]] = []
    seen: set[int] = set()
    for read in reads:
        dp, pp, tp = read.coords
        if tp >= layout.tp or pp >= layout.pp or dp >= layout.dp:
            shape = f"TP {layout.tp}, PP {layout.pp}, DP {layout.dp}"
            problems.append(f"{read.path}: dp {dp} pp {pp} tp {tp} is outside the layout ({shape}): not read")
            continue
        rank = read.global_rank if read.global_rank is not None else groups.rank(dp, pp, tp)
        if rank in seen:
            problems.append(f"{read.path}: a second trace of rank {rank}: ignored")
            continue
        seen.add(rank)
        ranked.append((rank, read))
    ranked.sort(key=lambda pair: pair[0])
    for rank, read in ranked:
        if read.outside:
            problems.append(f"rank {rank}: {read.outside} records outside any iteration (evaluation) not analysed")
        if read.unmapped:
            names = ", ".join(f"{name} x{count}" for name, count in sorted(read.unmapped.items()))
            problems.append(f"rank {rank}: scopes rankwatch does not analyse: {names}")
    spans = np.concatenate([_spans(rank, read) for rank, read in ranked]) if ranked else np.zeros(0, SPAN_DTYPE)
    iterations = np.array(
        [(rank, *it) for rank, read in ranked for it in read.iterations], ITERATION_DTYPE
    ) if any(read.iterations for _, read in ranked) else np.zeros(0, ITERATION_DTYPE)  # fmt: skip
    calls = _number_p2p_per_peer(_calls(ranked, groups))
    calls = calls[np.lexsort((calls["t_call"], calls["rank"]))]
    sources = {rank: RankSource(rank, "unknown", -1, read.path, layout.world_size) for rank, read in ranked}
    used = set(np.unique(calls["comm"]).tolist())
    comms = {comm_id: comm for comm_id, comm in groups.comms.items() if comm_id in used}
    if not len(calls):
        problems.append(
            "the traces record no communication (MegaScan's --trace-granularity full records it): ranks are "
            "compared by their forward/backward compute and the iterations' times only"
        )
    elif layout.pp > 1 and not np.isin(calls["op"], P2P_OPS).any():
        problems.append("the traces record no pipeline send/receive: slow links are not judged")
    return Trace(calls, sources, comms, problems, has_returns=True, layout=layout, spans=spans, iterations=iterations)


def write_traces(trace: Trace, directory: str | Path, microbatches: int) -> list[Path]:
    """One ``benchmark-data-<dp>-pipeline-<pp>-tensor-<tp>.json`` per rank of a generated or simulated run
    (the model of ``standins/scenario.py``, or the rings of ``rankwatch simulate`` with TP > 1: per
    iteration the forward of each microbatch, then the backwards, with their TP collectives and pipeline
    sends and receives, then the DP and world AllReduces), as MegaScan writes them with
    ``--trace-granularity full``: one forward/backward span per microbatch (its TP collectives inside),
    the communication scopes, and each iteration between two ends of the world AllReduce (the first
    iteration, with no start, is left out), each record with the rank's coordinates as newer versions
    add them. GPU times where recorded, else host times (the synchronous model's). Raises ValueError
    when a rank's steps cannot be split into ``microbatches`` forwards and backwards."""
    if trace.layout is None:
        raise ValueError("write_traces needs the run's layout (trace.layout)")
    layout, directory = trace.layout, Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    kinds = {c.id: layout.group_kind(set(c.members.values())) for c in trace.comms.values()}
    world_comms = [comm_id for comm_id, kind in kinds.items() if kind == "world"]
    if len(world_comms) > 1:  # one group of the layout is the world (TP 8 of 8): the step ends at the rarest
        calls_on = {comm_id: int((trace.calls["comm"] == comm_id).sum()) for comm_id in world_comms}
        world_comms = [min(world_comms, key=calls_on.__getitem__)]
        axis = "TP" if layout.tp == layout.world_size else "DP" if layout.dp == layout.world_size else "PP"
        kinds.update({comm_id: axis for comm_id in calls_on if comm_id not in world_comms})
    written = []
    for rank in sorted(trace.ranks):
        calls = trace.calls[trace.rows_of(rank)]
        begin = np.where(calls["gpu_start"] > 0, calls["gpu_start"], calls["t_call"]).astype(np.int64)
        end = np.where(calls["gpu_end"] > 0, calls["gpu_end"], calls["t_return"]).astype(np.int64)
        order = np.argsort(begin, kind="stable")
        calls, begin, end = calls[order], begin[order], end[order]
        ends_step = np.flatnonzero(np.isin(calls["comm"], world_comms) & (end > 0))
        tp, dp, pp = layout.coords(rank)
        records: list[dict[str, Any]] = []
        for first, last in zip(ends_step[:-1].tolist(), ends_step[1:].tolist(), strict=True):
            step = slice(first + 1, last + 1)
            kind = np.array([kinds.get(comm_id, "") for comm_id in calls["comm"][step].tolist()])
            records += _iteration_records(calls[step], kind, begin[step], end[step], int(end[first]), microbatches, pp)
        where = {"dp_rk": dp, "pp_rk": pp, "tp_rk": tp, "dev": rank % 8, "g_rk": rank}  # as newer versions write
        records = [record if "pad_before" in record else {**record, **where} for record in records]
        path = directory / f"benchmark-data-{dp}-pipeline-{pp}-tensor-{tp}.json"
        path.write_text(json.dumps(records))
        written.append(path)
    return written


def _scope_records(name: str, begin: int, end: int, **attrs: Any) -> list[dict[str, Any]]:
    return [{"name": name, "ph": "B", "rel_ts": begin}, {"name": name, "ph": "E", "rel_ts": end, **attrs}]


def _p2p_name(op: int, peer: int, stage: int) -> str:
    """MegaScan's name of a pipeline send or receive: forward goes to the next stage, backward to the previous."""
    verb = "send" if op == Op.SEND else "recv"
    return f"{verb}-{'forward' if (verb == 'send') == (peer > stage) else 'backward'}"


def _phases_by_tp_calls(
    calls: np.ndarray,
    group_kind: np.ndarray,
    begin: np.ndarray,
    end: np.ndarray,
    start: int,
    microbatches: int,
    stage: int,
) -> list[dict[str, Any]]:
    """With tensor parallelism a microbatch's forward (and its backward) holds the same number of TP
    collectives on every microbatch: the forward's are the first run of them (the step's first
    forward is followed by a send, a receive or the next forward's receive; ``rankwatch simulate``'s
    driver and the model alike), the backward's the rest; without a pipeline nothing separates them and
    a microbatch's are taken as halves. A span runs from the end of the call before its first TP
    collective to the end of its last."""
    tp = np.flatnonzero(group_kind == "TP")
    breaks = np.flatnonzero(np.diff(tp) > 1)
    per_microbatch = len(tp) // microbatches if microbatches else 0
    # no pipeline: nothing between the TP collectives tells a forward's from a backward's; taken as halves
    forward = int(breaks[0]) + 1 if len(breaks) else (per_microbatch // 2 if per_microbatch % 2 == 0 else 0)
    backward = per_microbatch - forward
    if not per_microbatch or len(tp) % microbatches or forward < 1 or backward < 1:
        raise ValueError(
            f"rank at pipeline stage {stage}: {len(tp)} TP collectives in a step do not split into {microbatches} "
            "microbatches' forward and backward: MegaScan's spans cannot be placed"
        )
    sizes = [forward] * microbatches + [backward] * microbatches
    phase_of = np.repeat(np.arange(2 * microbatches), sizes)
    first = {int(tp[i]): int(phase_of[i]) for i in np.r_[0, np.cumsum(sizes)[:-1]]}
    last = {int(tp[i]): int(phase_of[i]) for i in np.cumsum(sizes) - 1}
    records: list[dict[str, Any]] = [{"name": "iteration", "ph": "B", "pad_before": 0}]
    for index in range(len(calls)):
        if index in first:
            opened = int(end[index - 1]) if index else start
            kind = "forward" if first[index] < microbatches else "backward"
            records.append({"name": kind, "ph": "B", "rel_ts": opened - start})
        op = int(calls["op"][index])
        if group_kind[index] == "TP":
            name = TP_SCOPES.get(Op(op), "_reduce")
            records += _scope_records(name, int(begin[index]) - start, int(end[index]) - start, group=None)
        elif op in (Op.SEND, Op.RECV):
            name = _p2p_name(op, int(calls["peer"][index]), stage)
            data = int(calls["count"][index])
            records += _scope_records(name, int(begin[index]) - start, int(end[index]) - start, data=data)
        if index in last:
            phase = last[index]
            kind, microbatch = ("forward", phase) if phase < microbatches else ("backward", phase - microbatches)
            records.append({"microbatch": microbatch, "model_chunk": 0, "pp_rank": stage, "name": kind, "ph": "E",
                            "rel_ts": int(end[index]) - start})  # fmt: skip
    return records


def _iteration_records(
    calls: np.ndarray,
    group_kind: np.ndarray,
    begin: np.ndarray,
    end: np.ndarray,
    start: int,
    microbatches: int,
    stage: int,
) -> list[dict[str, Any]]:
    """One iteration's records (``group_kind``: each call's group kind, TP, DP, PP or world), or none when
    it is incomplete (a hung rank's last iteration: MegaScan writes only iterations that ended)."""
    if (end <= 0).any():
        return []
    closing = np.flatnonzero(np.isin(group_kind, ("DP", "world")))  # the DP and world AllReduces end the step
    tail = int(closing[0]) if len(closing) else len(calls)
    body = np.arange(tail)
    if (group_kind[body] == "TP").any():
        records = _phases_by_tp_calls(calls[:tail], group_kind[:tail], begin, end, start, microbatches, stage)
        return records + _tail_records(calls, group_kind, begin, end, start, tail)
    # a phase (one microbatch's forward or backward) ends with its pipeline exchange
    p2p = np.isin(calls["op"][body], P2P_OPS)
    if p2p.any():
        group = calls["group"][body]
        last_of_phase = np.flatnonzero(p2p & np.r_[group[1:] != group[:-1], True])
        first_of_exchange = np.flatnonzero(p2p & np.r_[True, group[1:] != group[:-1]])
    else:
        per_phase = len(body) // (2 * microbatches) if microbatches else 0
        last_of_phase = first_of_exchange = np.arange(per_phase - 1, len(body), per_phase) if per_phase else body
    if len(last_of_phase) != 2 * microbatches or (not p2p.any() and len(body) % (2 * microbatches)):
        raise ValueError(
            f"rank at pipeline stage {stage}: a step of {len(body)} calls before its DP and world AllReduces is not "
            f"{microbatches} microbatches' forward and backward, each ending in TP collectives or a pipeline "
            "exchange (the model of standins/scenario.py): MegaScan's spans cannot be placed"
        )
    records: list[dict[str, Any]] = [{"name": "iteration", "ph": "B", "pad_before": 0}]

    def rel(at: int) -> int:
        return int(at) - start

    previous_end = start
    for phase, (last, exchange) in enumerate(zip(last_of_phase.tolist(), first_of_exchange.tolist(), strict=True)):
        kind, microbatch = ("forward", phase) if phase < microbatches else ("backward", phase - microbatches)
        span_end = int(begin[exchange]) if p2p.any() else int(end[last])
        records.append({"name": kind, "ph": "B", "rel_ts": rel(previous_end)})
        first = 0 if phase == 0 else int(last_of_phase[phase - 1]) + 1
        for index in range(first, exchange if p2p.any() else last + 1):
            name = TP_SCOPES.get(Op(int(calls["op"][index])), "_reduce")
            records += [{"name": name, "ph": "B", "rel_ts": rel(begin[index])},
                        {"name": name, "ph": "E", "rel_ts": rel(end[index]), "group": None}]  # fmt: skip
        records.append({"microbatch": microbatch, "model_chunk": 0, "pp_rank": stage, "name": kind, "ph": "E",
                        "rel_ts": rel(span_end)})  # fmt: skip
        if p2p.any():
            for index in range(exchange, last + 1):
                towards_next = int(calls["peer"][index]) > stage
                verb = "send" if calls["op"][index] == Op.SEND else "recv"
                direction = "forward" if (verb == "send") == towards_next else "backward"
                name = f"{verb}-{direction}"
                records += [{"name": name, "ph": "B", "rel_ts": rel(begin[index])},
                            {"name": name, "ph": "E", "rel_ts": rel(end[index]),
                             "data": int(calls["count"][index])}]  # fmt: skip
        previous_end = int(end[last])
    return records + _tail_records(calls, group_kind, begin, end, start, tail)


def _tail_records(
    calls: np.ndarray, group_kind: np.ndarray, begin: np.ndarray, end: np.ndarray, start: int, tail: int
) -> list[dict[str, Any]]:
    """The step's DP AllReduces (MegaScan's ``allreduce``) and the iteration's end, after its microbatches."""
    records = []
    for index in range(tail, len(calls)):
        if group_kind[index] == "DP":
            records += _scope_records("allreduce", int(begin[index]) - start, int(end[index]) - start)
    duration = int(end[-1]) - start
    records.append({"name": "iteration", "ph": "E", "rel_ts": duration, "duration_cuda": duration,
                    "duration_wall": duration})  # fmt: skip
    return records
