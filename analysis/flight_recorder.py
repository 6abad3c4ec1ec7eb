"""PyTorch NCCL Flight Recorder dumps (JSON or pickle) into a Trace.

One dump per rank (``<prefix><rank>``, prefix from TORCH_NCCL_DEBUG_INFO_TEMP_FILE, by default
``nccl_trace_rank_``): ``pg_config`` names each process group and its global ranks, ``entries`` the
last collectives with ``collective_seq_id`` / ``p2p_seq_id``, ``profiling_name`` (``nccl:all_reduce``,
``nccl:send 0->1``), ``input_sizes``, ``state`` (scheduled / started / completed) and
``time_created_ns`` / ``time_discovered_started_ns`` / ``time_discovered_completed_ns``. A scheduled
entry whose peers started tells a rank stuck before its kernel ran from ranks merely waiting.

Pickles are read with an unpickler that admits plain data only (dict, list, tuple, str, bytes,
numbers, bool, None): any class or function reference is refused before anything is built.
"""

from __future__ import annotations

import ast
import io
import json
import math
import pickle
import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from rankwatch.analysis.progress import Progress
from rankwatch.analysis.ring import Op
from rankwatch.analysis.trace import CALL_DTYPE, Communicator, RankSource, Trace

OPS = {
    "all_reduce": Op.ALLREDUCE, "allreduce": Op.ALLREDUCE, "broadcast": Op.BROADCAST, "reduce": Op.REDUCE,
    "all_gather": Op.ALLGATHER, "allgather": Op.ALLGATHER, "_allgather_base": Op.ALLGATHER,
    "all_gather_into_tensor_coalesced": Op.ALLGATHER, "reduce_scatter": Op.REDUCESCATTER,
    "_reduce_scatter_base": Op.REDUCESCATTER, "reduce_scatter_tensor_coalesced": Op.REDUCESCATTER,
    "all_to_all": Op.ALLTOALL, "alltoall": Op.ALLTOALL, "alltoall_base": Op.ALLTOALL, "gather": Op.GATHER,
    "scatter": Op.SCATTER, "send": Op.SEND, "recv": Op.RECV, "allreduce_coalesced": Op.ALLREDUCE,
}  # fmt: skip
P2P_NAME = re.compile(r"^nccl:(send|recv) (\d+)(?:->|<-)(\d+)$")


class FlightRecorderError(ValueError):
    """A dump rankwatch cannot read; the message names the file and what is wrong."""


class _PlainDataUnpickler(pickle.Unpickler):
    """Builds only what pickle can express without globals: containers, strings, numbers."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: only plain data is accepted")


def _load(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    if data[:2] in (b"\x78\x9c", b"\x78\x01", b"\x78\xda"):  # zlib-compressed dumps
        try:
            data = zlib.decompress(data)
        except zlib.error as error:
            raise FlightRecorderError(f"{path}: corrupt compressed dump: {error}") from error
    try:
        is_json = data.lstrip()[:1] == b"{"
        dump = json.loads(data) if is_json else _PlainDataUnpickler(io.BytesIO(data)).load()
    except json.JSONDecodeError as error:
        raise FlightRecorderError(f"{path}: line {error.lineno}: not valid JSON: {error.msg}") from error
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError) as error:
        raise FlightRecorderError(f"{path}: not a readable flight-recorder pickle: {error}") from error
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
        raise FlightRecorderError(f"{path}: no 'entries' list: not a flight-recorder dump")
    return dump


def _rank_of(path: Path, dump: dict[str, Any]) -> int:
    if isinstance(dump.get("rank"), int):
        return dump["rank"]
    match = re.search(r"(\d+)(?:\.\w+)?$", path.name)
    if not match:
        raise FlightRecorderError(f"{path}: cannot tell the rank (no number at the end of the file name)")
    return int(match.group(1))


def _ranks_of_group(config: dict[str, Any]) -> list[int]:
    ranks = config.get("ranks", [])
    if isinstance(ranks, str):  # newer dumps store the list as its text
        ranks = ast.literal_eval(ranks) if ranks.strip() else []
    return [int(r) for r in ranks]


def _group_id(name: str) -> int:
    return zlib.crc32(name.encode()) | (1 << 40)  # distinct from ring ids in practice; equal on all ranks


def _convert(path: Path, dump: dict[str, Any], rank: int, comms: dict[int, Communicator]) -> np.ndarray:
    groups = dump.get("pg_config") or {}
    members: dict[str, list[int]] = {}
    for key, config in groups.items():
        if isinstance(config, dict):
            members[str(config.get("name", key))] = _ranks_of_group(config)
    rows = []
    for number, entry in enumerate(dump["entries"]):
        if not isinstance(entry, dict):
            raise FlightRecorderError(f"{path}: entry {number} is not a record")
        name = str(entry.get("profiling_name", ""))
        group = entry.get("process_group") or ("", "")
        group_name = str(group[0] if isinstance(group, list | tuple) else group)
        ranks = members.get(group_name, [])
        p2p = P2P_NAME.match(name)
        kind = p2p.group(1) if p2p else name.split(":", 1)[-1]
        op = OPS.get(kind)
        if op is None:
            continue  # barrier, coalesced markers and the like carry no rank to blame
        sizes = entry.get("input_sizes") or [[]]
        count = math.prod(sizes[0]) if sizes and isinstance(sizes[0], list | tuple) else 0
        state = entry.get("state", "")
        comm_id = _group_id(group_name)
        comm_rank = ranks.index(rank) if rank in ranks else -1
        peer = int(p2p.group(3)) if p2p else -1  # "nccl:send 0->1", "nccl:recv 1<-0": the peer comes last
        seq = entry.get("p2p_seq_id" if p2p else "collective_seq_id", 0) or 0
        completed = state == "completed"
        started = int(entry.get("time_discovered_started_ns") or 0) if state in ("started", "completed") else 0
        duration = entry.get("duration_ms")  # GPU time, with TORCH_NCCL_ENABLE_TIMING
        if completed and started and isinstance(duration, int | float):
            gpu_end = started + int(duration * 1e6)
        else:
            gpu_end = int(entry.get("time_discovered_completed_ns") or 0) if completed else 0
        rows.append(
            (
                rank, comm_id, int(seq), int(op), int(count), 0, peer, comm_rank, len(ranks),
                int(entry.get("time_created_ns") or 0),
                int(entry.get("time_discovered_completed_ns") or entry.get("time_created_ns") or 0) if completed else 0,
                started,
                gpu_end,
                0,
            )
        )  # fmt: skip
        comm = comms.setdefault(comm_id, Communicator(comm_id, len(ranks), dict(enumerate(ranks))))
        comm.members.update(enumerate(ranks))
    calls = np.array(rows, dtype=CALL_DTYPE) if rows else np.zeros(0, CALL_DTYPE)
    return _number_p2p_per_peer(calls)


def _number_p2p_per_peer(calls: np.ndarray) -> np.ndarray:
    """p2p_seq_id counts all of a group's sends and receives; the n-th send a->b must meet the n-th
    receive b<-a, so sends and receives are numbered per (group, direction, peer) in call order."""
    p2p = np.flatnonzero(np.isin(calls["op"], (Op.SEND, Op.RECV)))
    if not len(p2p):
        return calls
    order = p2p[np.lexsort((calls["t_call"][p2p], calls["peer"][p2p], calls["op"][p2p], calls["comm"][p2p]))]
    keys = np.stack([calls["comm"][order].astype(np.int64), calls["op"][order], calls["peer"][order]], axis=1)
    new = np.r_[True, (keys[1:] != keys[:-1]).any(axis=1)]
    starts = np.flatnonzero(new)
    position = np.arange(len(order)) - np.repeat(starts, np.diff(np.r_[starts, len(order)]))
    calls["seq"][order] = position + 1
    return calls


def read_dumps(paths: list[Path]) -> Trace:
    parts, ranks, comms, problems = [], {}, {}, []
    paths = sorted(paths)
    progress = Progress(len(paths), "reading flight-recorder dumps")
    for path in paths:
        progress.advance()
        try:
            dump = _load(path)
            rank = _rank_of(path, dump)
            calls = _convert(path, dump, rank, comms)
        except (FlightRecorderError, OSError, SyntaxError, ValueError) as error:
            problems.append(str(error))
            continue
        ranks[rank] = RankSource(rank, str(dump.get("hostname", "unknown")), int(dump.get("pid", -1) or -1), str(path))
        parts.append(calls)
    progress.close()
    calls = np.concatenate(parts) if parts else np.zeros(0, CALL_DTYPE)
    calls = calls[np.lexsort((calls["t_call"], calls["rank"]))]
    return Trace(calls, ranks, comms, problems)


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
