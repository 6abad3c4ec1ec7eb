"""PyTorch Flight Recorder dumps (JSON or pickle) into a Trace, as PyTorch really writes them.

One dump per rank (``<prefix><rank>``, prefix from TORCH_FR_DUMP_TEMP_FILE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE,
by default ``nccl_trace_rank_``), from ``_dump_fr_trace`` (pickle) or ``_dump_fr_trace_json``. What a dump
holds depends on the backend and on PyTorch's version, and the reader takes each field for what it is:

- ``entries``: the recorder's ring (``TORCH_FR_BUFFER_SIZE``, oldest first) with ``collective_seq_id`` /
  ``p2p_seq_id`` (older versions: ``seq_id``), ``profiling_name`` (``nccl:all_reduce``, ``gloo:all_reduce``,
  ``nccl:send 0->1``), ``process_group`` (name, desc), ``input_sizes``, ``state``, ``retired``,
  ``time_created_ns`` and, with NCCL, ``time_discovered_started_ns`` / ``time_discovered_completed_ns``
  (when the watchdog saw the CUDA events) and ``duration_ms`` (GPU time, TORCH_NCCL_ENABLE_TIMING);
  ``frames``: the Python stack of the call. A JSON dump of a rank that recorded nothing has no entries.
- Completion: ``state`` "completed", else ``retired``, else ``pg_status[pg_id].last_completed_collective``.
  Gloo records every entry as "scheduled" with no times and marks a collective ``retired`` when it ends,
  also when it ended by timing out; so a collective counts as completed only if no member that left a
  dump is behind it.
- Membership: ``pg_config`` (name -> ranks) when it describes the groups (NCCL); gloo dumps carry one
  empty-named entry, so members are the ranks whose dumps record the group, the world for the default
  group, and when dumps are missing the Megatron layout's group that fits (or, without a layout, the
  ranks without a dump for a group no other dump records).
- Send/receive: NCCL records them; gloo does not. Then, with a pipeline in the layout, a rank that others
  wait for may be inside an unrecorded send/receive with its pipeline neighbours
  (``Trace.unrecorded_partners``).

Untrusted input: pickles are read with an unpickler that admits plain data only (dict, list, tuple, str,
bytes, numbers, bool, None: any class or function reference is refused before anything is built), after
a scan that refuses memo indices a pickler would never write; compressed dumps, files and tensor
shapes are bounded.
"""

from __future__ import annotations

import ast
import io
import json
import math
import pickle
import pickletools
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rankwatch.analysis.job_noise import clock_tick_ns
from rankwatch.analysis.progress import Progress
from rankwatch.analysis.ring import MAX_GLOBAL_RANK, Op
from rankwatch.analysis.topology import Layout
from rankwatch.analysis.trace import CALL_DTYPE, Communicator, Frame, RankSource, Trace

OPS = {
    "all_reduce": Op.ALLREDUCE, "allreduce": Op.ALLREDUCE, "broadcast": Op.BROADCAST, "reduce": Op.REDUCE,
    "all_gather": Op.ALLGATHER, "allgather": Op.ALLGATHER, "_allgather_base": Op.ALLGATHER,
    "all_gather_into_tensor_coalesced": Op.ALLGATHER, "reduce_scatter": Op.REDUCESCATTER,
    "_reduce_scatter_base": Op.REDUCESCATTER, "reduce_scatter_tensor_coalesced": Op.REDUCESCATTER,
    "all_to_all": Op.ALLTOALL, "alltoall": Op.ALLTOALL, "alltoall_base": Op.ALLTOALL, "gather": Op.GATHER,
    "scatter": Op.SCATTER, "send": Op.SEND, "recv": Op.RECV, "allreduce_coalesced": Op.ALLREDUCE,
}  # fmt: skip
P2P_NAME = re.compile(r"^\w+:(send|recv) (\d+)(?:->|<-)(\d+)$")
DEFAULT_GROUP_DESC = "default_pg"

MAX_DUMP_BYTES = 1 << 30  # a dump of 2,000 entries with stacks is a few MB
MAX_MEMO_INDEX = 1 << 24  # picklers number memo slots from 0, one per object written
MAX_DIMS = 64  # tensors have at most a few dozen dimensions
COUNT_CAP = (1 << 63) - 1


class FlightRecorderError(ValueError):
    """A dump rankwatch cannot read; the message names the file and what is wrong."""


class _PlainDataUnpickler(pickle.Unpickler):
    """Builds only what pickle can express without globals: containers, strings, numbers."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: only plain data is accepted")


_MEMO_WRITES = {"PUT", "BINPUT", "LONG_BINPUT"}


def _check_memo(data: bytes, path: Path) -> None:
    """Refuse a pickle whose memo indices run past what its own opcodes could have filled: the C
    unpickler sizes its memo to the largest index, so one LONG_BINPUT 2**31 would claim 16 GB."""
    try:
        for count, (opcode, argument, _) in enumerate(pickletools.genops(data)):
            if opcode.name in _MEMO_WRITES and int(argument) > min(count, MAX_MEMO_INDEX):
                raise FlightRecorderError(f"{path}: pickle memo index {argument} at opcode {count}: refused")
    except (ValueError, TypeError) as error:
        if isinstance(error, FlightRecorderError):
            raise
        raise FlightRecorderError(f"{path}: not a readable flight-recorder pickle: {error}") from error


def _decompress(data: bytes, path: Path) -> bytes:
    """zlib-compressed dumps, inflated to at most MAX_DUMP_BYTES (a small bomb cannot take the memory)."""
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, MAX_DUMP_BYTES)
    except zlib.error as error:
        raise FlightRecorderError(f"{path}: corrupt compressed dump: {error}") from error
    if inflater.unconsumed_tail:
        raise FlightRecorderError(f"{path}: compressed dump inflates past {MAX_DUMP_BYTES >> 20} MiB: refused")
    return out


def _load(path: Path) -> dict[str, Any]:
    with open(path, "rb") as handle:
        data = handle.read(MAX_DUMP_BYTES + 1)
    if len(data) > MAX_DUMP_BYTES:
        raise FlightRecorderError(f"{path}: larger than {MAX_DUMP_BYTES >> 20} MiB: not a flight-recorder dump")
    if data[:2] in (b"\x78\x9c", b"\x78\x01", b"\x78\xda"):
        data = _decompress(data, path)
    is_json = data.lstrip()[:1] == b"{"
    try:
        if is_json:
            dump = json.loads(data)
        else:
            _check_memo(data, path)
            dump = _PlainDataUnpickler(io.BytesIO(data)).load()
    except json.JSONDecodeError as error:
        raise FlightRecorderError(f"{path}: line {error.lineno}: not valid JSON: {error.msg}") from error
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        IndexError,
        KeyError,
        AttributeError,
        OverflowError,
        RecursionError,
        MemoryError,
    ) as error:  # fmt: skip  (a damaged pickle's opcodes fail in any of these: APPEND on a dict, ...)
        raise FlightRecorderError(f"{path}: not a readable flight-recorder pickle: {error}") from error
    if not isinstance(dump, dict):
        raise FlightRecorderError(f"{path}: no 'entries' list: not a flight-recorder dump")
    if "entries" not in dump and "pg_config" in dump and "version" in dump:
        dump["entries"] = []  # a JSON dump of a rank that recorded nothing leaves the key out
    if not isinstance(dump.get("entries"), list):
        raise FlightRecorderError(f"{path}: no 'entries' list: not a flight-recorder dump")
    return dump


def _rank_of(path: Path, dump: dict[str, Any]) -> int:
    if isinstance(dump.get("rank"), int) and not isinstance(dump.get("rank"), bool):
        rank = dump["rank"]
    else:
        match = re.search(r"(\d+)(?:\.\w+)?$", path.name)
        if not match:
            raise FlightRecorderError(f"{path}: cannot tell the rank (no number at the end of the file name)")
        rank = int(match.group(1))
    if not 0 <= rank <= MAX_GLOBAL_RANK:
        raise FlightRecorderError(f"{path}: rank {rank} is outside 0..{MAX_GLOBAL_RANK}")
    return rank


def _ranks_of_group(config: Any) -> list[int]:
    ranks = config.get("ranks", []) if isinstance(config, dict) else []
    if isinstance(ranks, str):  # stored as its text ("[0, 1]")
        ranks = ast.literal_eval(ranks) if ranks.strip() else []
    # Ranks index per-rank arrays (and the list of ranks without a dump): bounded like a ring's.
    if not isinstance(ranks, list | tuple) or not all(isinstance(r, int) and 0 <= r <= MAX_GLOBAL_RANK for r in ranks):
        raise FlightRecorderError(f"pg_config ranks {str(ranks)[:80]!r} are not a list of ranks")
    return [int(r) for r in ranks]


def _group_id(name: str) -> int:
    return zlib.crc32(name.encode()) | (1 << 40)  # distinct from ring ids in practice; equal on all ranks


def _element_count(sizes: Any) -> int:
    """Elements of the first tensor (``input_sizes[0]``), saturating: a hostile shape of a million
    huge dimensions costs no more than a real one."""
    if not isinstance(sizes, list | tuple) or not sizes or not isinstance(sizes[0], list | tuple):
        return 0
    dims = sizes[0]
    if len(dims) > MAX_DIMS or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise FlightRecorderError(f"input_sizes {str(dims)[:80]}: not a tensor shape")
    count = 1
    for dim in dims:
        count = min(count * min(dim, COUNT_CAP), COUNT_CAP)
    return count


MAX_DURATION_MS = 30 * 24 * 3600 * 1e3
"""A collective's duration the reader takes: a month (NCCL's own timeouts are minutes)."""


def _integer(value: Any, what: str) -> int:
    if value is None or value == "":
        return 0
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise FlightRecorderError(f"{what} {str(value)[:40]!r} is not a number")
    try:
        number = int(value)
    except (ValueError, OverflowError) as error:  # text, NaN, infinity
        raise FlightRecorderError(f"{what} {str(value)[:40]!r} is not a number") from error
    if not -(1 << 63) <= number < 1 << 63:
        raise FlightRecorderError(f"{what} {number} does not fit in 64 bits")
    return number


def _frames(entry: dict[str, Any]) -> tuple[Frame, ...]:
    frames = entry.get("frames")
    if not isinstance(frames, list):
        return ()
    return tuple(
        Frame(str(f.get("filename", "")), _integer(f.get("line"), "frame line"), str(f.get("name", "")))
        for f in frames[:64]
        if isinstance(f, dict)
    )


@dataclass
class _Record:
    """One entry, as read: what the columns need before groups and completion are settled."""

    group: str
    pg_id: int
    seq: int
    op: int
    count: int
    peer: int  # group rank of the send/recv peer, -1
    t_call: int
    t_started: int
    t_completed: int
    duration_ms: float | None
    completed: bool
    frames: tuple[Frame, ...]
    backend: str  # "nccl", "gloo", ...: the profiling name's prefix
    dtype: int = 0  # of the first input tensor (NCCL's datatype numbers; UNKNOWN_DTYPE when unnamed)
    timeout_ns: int = 0  # the collective's timeout (``timeout_ms``); 0 when not given
    retired: bool = False  # the recorder retired it: it ended, by completing or by timing out


@dataclass
class _RankDump:
    rank: int
    path: Path
    records: list[_Record]
    written_ns: int = 0  # the dump file's modification time: when the recorder's state was written
    group_desc: dict[str, str] = field(default_factory=dict)
    last_enqueued: dict[str, int] = field(default_factory=dict)  # group -> from pg_status


def _read_one(path: Path, dump: dict[str, Any], configs: dict[str, list[int]]) -> _RankDump:
    rank = _rank_of(path, dump)
    if not isinstance(dump.get("pg_config") or {}, dict):
        raise FlightRecorderError(f"{path}: pg_config is not a mapping")
    for key, config in (dump.get("pg_config") or {}).items():
        if isinstance(config, dict) and str(config.get("name", key)):
            ranks = _ranks_of_group(config)
            if ranks:
                configs.setdefault(str(config.get("name", key)), ranks)
    status = dump.get("pg_status") or {}
    if not isinstance(status, dict):
        raise FlightRecorderError(f"{path}: pg_status is not a mapping")
    statuses = {str(pg): s for pg, s in status.items() if isinstance(s, dict)}
    completed_up_to = {pg: _integer(s.get("last_completed_collective"), "pg_status") for pg, s in statuses.items()}
    enqueued_up_to = {pg: _integer(s.get("last_enqueued_collective"), "pg_status") for pg, s in statuses.items()}
    result = _RankDump(rank, path, [])
    for number, entry in enumerate(dump["entries"]):
        if not isinstance(entry, dict):
            raise FlightRecorderError(f"{path}: entry {number} is not a record")
        try:
            record = _record(entry, completed_up_to)
        except FlightRecorderError as error:
            raise FlightRecorderError(f"{path}: entry {number}: {error}") from None
        if record is None:
            continue
        group = entry.get("process_group")
        desc = str(group[1]) if isinstance(group, list | tuple) and len(group) > 1 else ""
        result.group_desc.setdefault(record.group, desc)
        if str(record.pg_id) in enqueued_up_to and record.op not in (Op.SEND, Op.RECV):
            result.last_enqueued[record.group] = enqueued_up_to[str(record.pg_id)]
        result.records.append(record)
    return result


def _record(entry: dict[str, Any], completed_up_to: dict[str, int]) -> _Record | None:
    name = str(entry.get("profiling_name", ""))
    p2p = P2P_NAME.match(name)
    kind = p2p.group(1) if p2p else name.split(":", 1)[-1]
    op = OPS.get(kind)
    if op is None:
        return None  # barrier, coalesced markers and the like carry no rank to blame
    group = entry.get("process_group")
    pg_id = _integer(entry.get("pg_id"), "pg_id")
    group_name = str(group[0] if isinstance(group, list | tuple) and group else (group if group else pg_id))
    seq_key = "p2p_seq_id" if p2p else ("collective_seq_id" if "collective_seq_id" in entry else "seq_id")
    seq = _integer(entry.get(seq_key), seq_key)
    if seq < 0:
        raise FlightRecorderError(f"{seq_key} {seq} is negative")
    peer = int(p2p.group(3)) if p2p else -1  # "nccl:send 0->1", "nccl:recv 1<-0": the peer comes last
    if peer > MAX_GLOBAL_RANK:
        raise FlightRecorderError(f"profiling_name {name[:60]!r}: peer {peer} is beyond {MAX_GLOBAL_RANK}")
    state = entry.get("state", "")
    completed = state == "completed" or entry.get("retired") is True
    if not p2p and str(pg_id) in completed_up_to and 0 < seq <= completed_up_to[str(pg_id)]:
        completed = True
    duration = entry.get("duration_ms")
    # NaN fails the range check too.
    if isinstance(duration, int | float) and not isinstance(duration, bool) and not 0 <= duration <= MAX_DURATION_MS:
        raise FlightRecorderError(f"duration_ms {str(duration)[:40]} is not a duration (0 to {MAX_DURATION_MS:g} ms)")
    return _Record(
        group=group_name,
        pg_id=pg_id,
        seq=seq,
        op=int(op),
        count=_element_count(entry.get("input_sizes")),
        peer=peer,
        t_call=_integer(entry.get("time_created_ns"), "time_created_ns"),
        t_started=_integer(entry.get("time_discovered_started_ns"), "time_discovered_started_ns")
        if state in ("started", "completed")
        else 0,
        t_completed=_integer(entry.get("time_discovered_completed_ns"), "time_discovered_completed_ns")
        if completed
        else 0,
        duration_ms=float(duration) if isinstance(duration, int | float) and not isinstance(duration, bool) else None,
        completed=completed,
        frames=_frames(entry),
        backend=name.split(":", 1)[0] if ":" in name else "",
        dtype=_dtype(entry.get("input_dtypes")),
        timeout_ns=int(min(max(0, _integer(entry.get("timeout_ms"), "timeout_ms")), MAX_DURATION_MS)) * 1_000_000,
        retired=entry.get("retired") is True,
    )


# PyTorch's dtype names (``input_dtypes``) as NCCL's datatype numbers, which rings record
DTYPES = {"Char": 0, "Byte": 1, "Int": 2, "UInt32": 3, "Long": 4, "UInt64": 5, "Half": 6, "Float": 7,
          "Double": 8, "BFloat16": 9, "Float8_e4m3fn": 10, "Float8_e5m2": 11}  # fmt: skip
UNKNOWN_DTYPE = 255  # named, but not one NCCL reduces (Bool, complex, ...): all such compare equal


def _dtype(dtypes: Any) -> int:
    if not isinstance(dtypes, list | tuple) or not dtypes or not isinstance(dtypes[0], str):
        return UNKNOWN_DTYPE
    return DTYPES.get(dtypes[0], UNKNOWN_DTYPE)


def _members(
    dumps: list[_RankDump], configs: dict[str, list[int]], layout: Layout | None, problems: list[str]
) -> tuple[dict[str, list[int]], list[int]]:
    """Global ranks of every group, and the ranks expected but without a dump."""
    dumped = {d.rank for d in dumps}
    world = layout.world_size if layout else max([*dumped, *(r for rs in configs.values() for r in rs)], default=-1) + 1
    missing = sorted(set(range(world)) - dumped)
    if missing:
        shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
        noun = "rank" if len(missing) == 1 else "ranks"
        problems.append(f"no flight-recorder dump for {noun} {shown} ({len(missing)} of {world} ranks)")
    seen: dict[str, set[int]] = {}
    descs: dict[str, str] = {}
    for d in dumps:
        for record in d.records:
            seen.setdefault(record.group, set()).add(d.rank)
        for group, desc in d.group_desc.items():
            descs.setdefault(group, desc)
    members: dict[str, list[int]] = {}
    in_use = _kinds_in_use(seen, layout) if missing and layout else set()
    for group, observed in seen.items():
        if group in configs:
            members[group] = configs[group]
        elif descs.get(group) == DEFAULT_GROUP_DESC:
            members[group] = list(range(world))
        elif missing and layout:
            members[group] = sorted(_layout_group(observed, dumped, layout, in_use) or observed)
        elif missing and len(observed) == 1:
            members[group] = sorted(observed | set(missing))  # a collective is never pending on its own
        else:
            members[group] = sorted(observed)
    return members, missing


LAYOUT_AXES = ((0,), (1,), (2,), (0, 1), (0, 2), (1, 2), (0, 1, 2))
"""The layout's group kinds by the coordinates (tp, dp, pp) their members differ in: TP, DP, PP, products."""


def _kinds_in_use(seen: dict[str, set[int]], layout: Layout) -> set[tuple[int, ...]]:
    """The kinds of layout group (as in :data:`LAYOUT_AXES`) of which some group of two or more ranks is
    seen whole: every member of one such group recorded in it."""
    dims = (layout.tp, layout.dp, layout.pp)
    kinds = set()
    for ranks in seen.values():
        if len(ranks) < 2:
            continue
        coords = [layout.coords(rank) for rank in ranks]
        axes = tuple(axis for axis in range(3) if len({c[axis] for c in coords}) > 1)
        if axes and len(ranks) == math.prod(dims[axis] for axis in axes):
            kinds.add(axes)
    return kinds


def _layout_group(
    observed: set[int], dumped: set[int], layout: Layout, in_use: set[tuple[int, ...]] = frozenset()
) -> set[int] | None:
    """The smallest group of the Megatron layout (TP, DP, PP and their products) that holds the ranks
    seen in a group and no other rank that left a dump; None when two fit equally. Kinds the job is seen
    using (``in_use``, :func:`_kinds_in_use`) come first: a rank alone in its TP group, whose peer left no
    dump, is not taken for the pipeline group of one it has with PP 1."""
    rank = min(observed)
    coords = layout.coords(rank)
    fits, used = [], []
    for axes in LAYOUT_AXES:
        fixed = [axis for axis in range(3) if axis not in axes]
        group = {r for r in range(layout.world_size) if all(layout.coords(r)[a] == coords[a] for a in fixed)}
        if observed <= group and group & dumped == observed and group not in fits:  # TP 1: TPxDP is DP
            fits.append(group)
            if axes in in_use:
                used.append(group)
    fits = sorted(used or fits, key=len)
    if not fits or (len(fits) > 1 and len(fits[0]) == len(fits[1])):
        return None
    return fits[0]


def _unfinished_by_members(dumps: list[_RankDump], members: dict[str, list[int]]) -> set[tuple[int, str, int]]:
    """A collective some member never entered cannot have completed (gloo retires timed-out work too):
    judged only from members that left a dump reaching back to it. Returns the (rank, group, seq) of
    the ranks stuck inside a collective that timed out for its other members (``_stuck_inside``)."""
    by_rank = {d.rank: d for d in dumps}
    last_seq: dict[tuple[int, str], int] = {}
    first_time: dict[int, int] = {}
    for d in dumps:
        times = [r.t_call for r in d.records if r.t_call > 0]
        first_time[d.rank] = min(times) if times else 1 << 62
        for record in d.records:
            if record.op not in (Op.SEND, Op.RECV):
                key = (d.rank, record.group)
                last_seq[key] = max(last_seq.get(key, 0), record.seq)
        for group, enqueued in d.last_enqueued.items():
            last_seq[(d.rank, group)] = max(last_seq.get((d.rank, group), 0), enqueued)
    instances: dict[tuple[str, int], list[_Record]] = {}
    for d in dumps:
        for record in d.records:
            if record.op in (Op.SEND, Op.RECV):
                continue
            instances.setdefault((record.group, record.seq), []).append(record)
            if not record.completed:
                continue
            for member in members.get(record.group, ()):
                if member == d.rank or member not in by_rank or first_time[member] > record.t_call:
                    continue
                if last_seq.get((member, record.group), 0) < record.seq:
                    record.completed, record.t_completed, record.duration_ms = False, 0, None
                    break
    stuck_inside = _stuck_inside(dumps, instances)
    timed_out = _timed_out(dumps, instances, members)
    # ... and one every member entered completed for all once any saw it complete (a dump can be
    # written between a collective's return and its retirement)
    for key, entered in instances.items():
        if key not in timed_out and len(entered) == len(members.get(key[0], ())) and any(r.completed for r in entered):
            for record in entered:
                record.completed = True
    return {key for key in stuck_inside if (key[1], key[2]) in timed_out}


def _stuck_inside(dumps: list[_RankDump], instances: dict[tuple[str, int], list[_Record]]) -> set[tuple[int, str, int]]:
    """Members whose work in a collective never ended, not even by timing out, while another member's
    did: gloo retires work when it ends, also by timing out, so work still unretired in a dump written a
    whole timeout after the call did not wait in the collective (that would have timed out): it is stuck
    inside it (its rank's worker never ran it, or hangs in it). Judged only where some member retired the
    instance and made no later call (it timed out there, rather than completing it and going on)."""
    last_call = {d.rank: max((r.t_call for r in d.records), default=0) for d in dumps}
    written = {d.rank: d.written_ns for d in dumps}
    rank_of = {id(r): d.rank for d in dumps for r in d.records}
    stuck = set()
    for (group, seq), entered in instances.items():
        ended = [r for r in entered if r.retired and r.t_call >= last_call[rank_of[id(r)]]]
        inside = [
            r
            for r in entered
            if not r.retired and r.timeout_ns > 0 and written[rank_of[id(r)]] - r.t_call >= r.timeout_ns
        ]
        if ended and inside:
            stuck |= {(rank_of[id(r)], group, seq) for r in inside}
    return stuck


def _timed_out(
    dumps: list[_RankDump], instances: dict[tuple[str, int], list[_Record]], members: dict[str, list[int]]
) -> set[tuple[str, int]]:
    """Collectives gloo retired because they timed out: every member that entered one made no call
    after it until its dump, written at least half the collective's timeout later (a collective that
    returned is followed by the rank's next call within a step; a dump written as the timeout fires can
    carry a file time rounded down by a copy, hence half; where every member entered, the whole timeout
    less the file times' resolution), and not every member left a record of it retired
    (one did not retire it, or some member left no dump to show it entered). Their records are made
    pending again: the members wait there. A rank that stopped outside NCCL after a collective that
    completed keeps it: its peers went on to later calls."""
    last_call = {d.rank: max((r.t_call for r in d.records), default=0) for d in dumps}
    written = {d.rank: d.written_ns for d in dumps}
    rank_of = {id(r): d.rank for d in dumps for r in d.records}
    file_tick = clock_tick_ns(np.array(list(written.values()), np.int64))  # a copy may round file times
    timed_out = set()
    for key, entered in instances.items():
        if not any(r.completed for r in entered):
            continue
        everyone_retired = len(entered) == len(members.get(key[0], ())) and all(r.completed for r in entered)
        if everyone_retired:
            continue
        # Where every member entered, a member's work still unretired may only have ended after its dump
        # began (a job's last collective, its dumps slow to write): only dumps written a whole timeout
        # after the calls, less one tick of the file times' resolution, say it timed out.
        whole = len(entered) == len(members.get(key[0], ()))
        share = 1 if whole else 2
        silent = all(
            r.timeout_ns > 0
            and r.t_call >= last_call[rank_of[id(r)]]
            and share * (written[rank_of[id(r)]] - r.t_call) + (file_tick if whole else 0) >= r.timeout_ns
            for r in entered
        )
        if silent:
            timed_out.add(key)
            for record in entered:
                record.completed, record.t_completed, record.duration_ms = False, 0, None
    return timed_out


def _rows(d: _RankDump, members: dict[str, list[int]], timed: bool) -> np.ndarray:
    rows = np.zeros(len(d.records), CALL_DTYPE)
    for i, record in enumerate(d.records):
        ranks = members.get(record.group, [])
        gpu_start = record.t_started if record.completed or record.t_started else 0
        if record.completed and gpu_start and record.duration_ms is not None:
            gpu_end = min(gpu_start + int(record.duration_ms * 1e6), (1 << 63) - 1)
        else:
            gpu_end = record.t_completed if record.completed else 0
        finished = (record.t_completed or record.t_call) if timed else -1  # -1: finished, time unknown
        t_return = finished if record.completed else 0
        rows[i] = (
            d.rank, _group_id(record.group), record.seq, record.op, record.count, record.dtype, record.peer,
            ranks.index(d.rank) if d.rank in ranks else -1, len(ranks), record.t_call, t_return,
            gpu_start, gpu_end, 0,
        )  # fmt: skip
    return rows


def _number_p2p_per_peer(calls: np.ndarray) -> np.ndarray:
    """p2p_seq_id counts all of a group's sends and receives; the n-th send a->b must meet the n-th
    receive b<-a, so sends and receives are numbered per (rank, group, direction, peer) in call order.
    The rank is part of the key: ``calls`` holds every rank's dump, and two ranks sending to the same
    peer of a group (a middle pipeline stage's neighbours) must not share one count."""
    p2p = np.flatnonzero(np.isin(calls["op"], (Op.SEND, Op.RECV)))
    if not len(p2p):
        return calls
    columns = (calls["peer"][p2p], calls["op"][p2p], calls["comm"][p2p], calls["rank"][p2p])
    order = p2p[np.lexsort((calls["t_call"][p2p], *columns))]
    keys = np.stack(
        [calls["rank"][order], calls["comm"][order].astype(np.int64), calls["op"][order], calls["peer"][order]], axis=1
    )
    new = np.r_[True, (keys[1:] != keys[:-1]).any(axis=1)]
    starts = np.flatnonzero(new)
    position = np.arange(len(order)) - np.repeat(starts, np.diff(np.r_[starts, len(order)]))
    calls["seq"][order] = position + 1
    return calls


def _written_ns(path: Path) -> int:
    try:
        return int(path.stat().st_mtime_ns)
    except OSError:
        return 0


def _observed_until(dumps: list[_RankDump]) -> int:
    """Until when the dumps watched the job: the latest of their writing (file times; copies keep them
    with ``cp -p``, tar, ``kubectl cp``) and of the timeouts that ran out, a collective the recorder
    retired though a member never entered it (gloo retires timed-out work) having waited its timeout."""
    until = max((d.written_ns for d in dumps), default=0)
    for d in dumps:
        for record in d.records:
            if record.retired and not record.completed and record.timeout_ns and record.t_call > 0:
                until = max(until, min(record.t_call + record.timeout_ns, (1 << 62)))
    return until


def _pipeline_neighbours(layout: Layout, rank: int) -> set[int]:
    tp, dp, pp = layout.coords(rank)
    return {tp + layout.tp * (dp + layout.dp * stage) for stage in (pp - 1, pp + 1) if 0 <= stage < layout.pp}


def read_dumps(paths: list[Path], layout: Layout | None = None) -> Trace:
    """``layout``: the job's Megatron layout, which completes the groups of ranks whose dumps are missing
    and tells the pipeline neighbours a gloo dump (no send/receive recorded) leaves unnamed."""
    dumps: list[_RankDump] = []
    sources: dict[int, RankSource] = {}
    configs: dict[str, list[int]] = {}
    problems: list[str] = []
    skipped: list[str] = []
    progress = Progress(len(paths), "reading flight-recorder dumps")
    for path in sorted(paths):
        progress.advance()
        try:
            dump = _load(path)
            rank_dump = _read_one(path, dump, configs)
        except (FlightRecorderError, OSError, SyntaxError, ValueError, RecursionError) as error:
            problems.append(str(error) if str(path) in str(error) else f"{path}: {error}")
            skipped.append(problems[-1])
            continue
        if rank_dump.rank in sources:
            problems.append(f"{path}: a second dump of rank {rank_dump.rank}: ignored")
            continue
        rank_dump.written_ns = _written_ns(path)
        host = dump.get("hostname", "unknown")
        sources[rank_dump.rank] = RankSource(rank_dump.rank, str(host), _integer(dump.get("pid", -1), "pid"), str(path))
        dumps.append(rank_dump)
    progress.close()

    members, _ = _members(dumps, configs, layout, problems)
    stuck_inside = _unfinished_by_members(dumps, members)
    records = [r for d in dumps for r in d.records]
    timed = any(r.completed and r.t_completed for r in records)
    parts = [_rows(d, members, timed) for d in dumps]
    calls = np.concatenate(parts) if parts else np.zeros(0, CALL_DTYPE)
    calls = _number_p2p_per_peer(calls)
    comms = {
        _group_id(group): Communicator(_group_id(group), len(ranks), dict(enumerate(ranks)))
        for group, ranks in sorted(members.items())
    }
    stacks = {
        (d.rank, _group_id(r.group), r.seq, r.op): r.frames for d in dumps for r in d.records if r.frames and r.peer < 0
    }
    order = np.lexsort((calls["t_call"], calls["rank"]))
    trace = Trace(
        calls[order], sources, comms, problems, skipped=skipped, has_returns=timed, pending_known=True, stacks=stacks
    )
    trace.observed_until_ns = _observed_until(dumps)
    trace.stuck_inside = {(rank, _group_id(group), seq) for rank, group, seq in stuck_inside}
    if not timed and records:
        problems.append(
            "the dumps carry no completion times (gloo records only when each call was made): ranks are "
            "compared by when they called"
        )
    p2p_unrecorded = {r.backend for r in records} == {"gloo"}  # gloo's recorder leaves send/recv out
    trace.calls_block_on_host = p2p_unrecorded  # gloo: collectives on the CPU, no GPU running behind
    if p2p_unrecorded and (layout is None or layout.pp > 1):
        trace.unrecorded_partners = {d.rank: _pipeline_neighbours(layout, d.rank) if layout else set() for d in dumps}
    return trace


PROFILING_NAMES = {Op.ALLREDUCE: "all_reduce", Op.BROADCAST: "broadcast", Op.REDUCE: "reduce",
                   Op.ALLGATHER: "all_gather", Op.REDUCESCATTER: "reduce_scatter", Op.ALLTOALL: "all_to_all",
                   Op.GATHER: "gather", Op.SCATTER: "scatter"}  # fmt: skip


def write_dumps(
    trace: Trace, directory: str | Path, as_pickle: bool = False, buffer_size: int | None = None
) -> list[Path]:
    """One ``nccl_trace_rank_<R>`` dump per rank, as PyTorch writes them with TORCH_NCCL_ENABLE_TIMING:
    the last ``buffer_size`` entries (the recorder's ring), a started time once the kernel ran and the
    GPU duration of completed entries."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = {comm_id: str(index) for index, comm_id in enumerate(sorted(trace.comms))}
    pg_config = {
        names[c.id]: {
            "name": names[c.id],
            "desc": trace.comm_name(c.id),
            "ranks": [c.members[i] for i in sorted(c.members)],
        }
        for c in trace.comms.values()
    }
    calls = trace.calls
    ranks = np.unique(calls["rank"])
    bounds = np.searchsorted(calls["rank"], np.r_[ranks, ranks[-1] + 1] if len(ranks) else [0])
    written = []
    for index, rank in enumerate(ranks.tolist()):
        mine = calls[bounds[index] : bounds[index + 1]]
        collective_seq: dict[int, int] = {}
        p2p_seq: dict[int, int] = {}
        entries = []
        for number, call in enumerate(mine.tolist()):
            _, comm_id, seq, op, count, _, peer, comm_rank, _, t_call, t_return, gpu_start, gpu_end, _ = call
            is_p2p = op in (Op.SEND, Op.RECV)
            if is_p2p:
                p2p_seq[comm_id] = p2p_seq.get(comm_id, 0) + 1
                arrow = "->" if op == Op.SEND else "<-"
                name = f"nccl:{'send' if op == Op.SEND else 'recv'} {comm_rank}{arrow}{peer}"
            else:
                collective_seq[comm_id] = seq
                name = f"nccl:{PROFILING_NAMES[Op(op)]}"
            state = "completed" if t_return > 0 else ("started" if gpu_start > 0 else "scheduled")
            group = names.get(comm_id, "unknown")
            entries.append({
                "record_id": number, "pg_id": int(group) if group.isdigit() else -1,
                "process_group": (group, pg_config.get(group, {}).get("desc", "")),
                "collective_seq_id": collective_seq.get(comm_id, 0), "p2p_seq_id": p2p_seq.get(comm_id, 0),
                "op_id": number + 1, "profiling_name": name, "input_sizes": [[count]], "input_dtypes": ["Float"],
                "output_sizes": [[count]], "output_dtypes": ["Float"], "state": state, "time_created_ns": t_call,
                "time_discovered_started_ns": gpu_start or None,
                "time_discovered_completed_ns": t_return if state == "completed" else None,
                "duration_ms": (gpu_end - gpu_start) / 1e6 if state == "completed" and gpu_end > 0 else None,
                "timeout_ms": 600_000, "retired": state == "completed", "is_p2p": is_p2p, "frames": [],
            })  # fmt: skip
        if buffer_size is not None:
            entries = entries[-buffer_size:]
        source = trace.ranks.get(rank)
        host = source.node if source else trace.node_of(rank)
        dump = {"version": "2.10", "rank": rank, "hostname": host, "pid": source.pid if source else -1,
                "pg_config": pg_config, "pg_status": {}, "entries": entries}  # fmt: skip
        path = directory / f"nccl_trace_rank_{rank}"
        path.write_bytes(pickle.dumps(dump) if as_pickle else json.dumps(dump).encode())
        written.append(path)
    return written
