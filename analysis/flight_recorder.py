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
        peer = -1
        if p2p:
            a, b = int(p2p.group(2)), int(p2p.group(3))
            peer = b if kind == "send" else a
        seq = entry.get("p2p_seq_id" if p2p else "collective_seq_id", 0) or 0
        completed = state == "completed"
        rows.append(
            (
                rank, comm_id, int(seq), int(op), int(count), 0, peer, comm_rank, len(ranks),
                int(entry.get("time_created_ns") or 0),
                int(entry.get("time_discovered_completed_ns") or entry.get("time_created_ns") or 0) if completed else 0,
                int(entry.get("time_discovered_started_ns") or 0) if state in ("started", "completed") else 0,
                int(entry.get("time_discovered_completed_ns") or 0) if completed else 0,
                0,
            )
        )  # fmt: skip
        comm = comms.setdefault(comm_id, Communicator(comm_id, len(ranks), dict(enumerate(ranks))))
        comm.members.update(enumerate(ranks))
    return np.array(rows, dtype=CALL_DTYPE) if rows else np.zeros(0, CALL_DTYPE)


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
