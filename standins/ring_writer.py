"""Write a Trace as ring files, byte for byte what the tracing library writes (rankwatch_ring.h).

For synthetic scenarios and tests: each rank's ring starts with the creation records of its
communicators (ncclCommInitRank, or ncclCommSplit with the parent in ``aux``), then its calls; a
``capacity`` smaller than that keeps only the newest records, as a wrapped ring does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rankwatch.analysis.ring import HEADER_DTYPE, HEADER_SIZE, MAGIC, RECORD_DTYPE, RECORD_SIZE, Flag, Op, State
from rankwatch.analysis.trace import Trace

GPU_TIMING_FLAG = 1


def _memberships(trace: Trace) -> dict[int, list[tuple[int, int, int]]]:
    """global rank -> [(communicator, rank in it, size)]"""
    joined: dict[int, list[tuple[int, int, int]]] = {}
    for comm in trace.comms.values():
        for comm_rank, rank in comm.members.items():
            joined.setdefault(rank, []).append((comm.id, comm_rank, comm.size))
    return joined


def write_rings(
    trace: Trace,
    directory: str | Path,
    capacity: int | None = None,
    parents: dict[int, int] | None = None,
    sensitivity_ms: int = 1000,
) -> list[Path]:
    """One ``rankwatch-<node>-<pid>.ring`` per rank; ``capacity`` (a power of two) wraps the rings."""
    if capacity is not None and (capacity <= 0 or capacity & (capacity - 1)):
        raise ValueError(f"ring capacity {capacity} is not a power of two")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    parents = parents or {}
    calls = trace.calls
    ranks = np.unique(calls["rank"])
    bounds = np.searchsorted(calls["rank"], np.r_[ranks, ranks[-1] + 1] if len(ranks) else [0])
    joined = _memberships(trace)
    gpu_timed = bool((calls["gpu_start"] > 0).any())
    written = []
    for index, rank in enumerate(ranks.tolist()):
        mine = calls[bounds[index] : bounds[index + 1]]
        creations = sorted(joined.get(rank, []))
        total = len(creations) + len(mine)
        size = capacity or 1 << max(total - 1, 0).bit_length()
        records = np.zeros(total, RECORD_DTYPE)
        first_call = int(mine["t_call"][0]) if len(mine) else 0
        for position, (comm_id, comm_rank, comm_size) in enumerate(creations):
            parent = parents.get(comm_id, 0)
            record = records[position : position + 1]
            record["op"] = Op.COMM_SPLIT if parent else Op.COMM_INIT
            record["comm_id"], record["aux"], record["rank"], record["nranks"] = comm_id, parent, comm_rank, comm_size
            record["t_call_ns"] = record["t_return_ns"] = first_call - 1_000_000
            record["state"] = State.RETURNED
        body = records[len(creations) :]
        for target, source in (("comm_id", "comm"), ("seq", "seq"), ("count", "count"), ("t_call_ns", "t_call"),
                               ("t_return_ns", "t_return"), ("gpu_start_ns", "gpu_start"), ("gpu_end_ns", "gpu_end"),
                               ("group_id", "group"), ("rank", "comm_rank"), ("nranks", "comm_size"), ("peer", "peer"),
                               ("op", "op"), ("dtype", "dtype")):  # fmt: skip
            body[target] = mine[source]
        body["state"] = np.where(mine["gpu_end"] > 0, State.GPU_DONE, np.where(mine["t_return"] > 0, State.RETURNED,
                                                                             State.ENTERED))  # fmt: skip
        body["flags"] = np.where(mine["group"] > 0, int(Flag.GROUPED), 0) | (int(Flag.GPU_TIMED) if gpu_timed else 0)
        records["global_rank"] = rank
        records["redop"] = 0
        claims = np.arange(total, dtype=np.uint64)
        records["stamp"] = claims * np.uint64(2) + np.uint64(2)
        kept = records[-size:]
        slots = np.zeros(size, RECORD_DTYPE)
        slots[(claims[-size:] % np.uint64(size)).astype(np.int64)] = kept

        source = trace.ranks.get(rank)
        node = source.node if source else trace.node_of(rank)
        pid = source.pid if source and source.pid > 0 else 1000 + rank
        header = np.zeros(1, HEADER_DTYPE)
        header["magic"], header["version"], header["header_size"], header["record_size"] = (
            MAGIC,
            1,
            HEADER_SIZE,
            RECORD_SIZE,
        )
        header["flags"] = GPU_TIMING_FLAG if gpu_timed else 0
        header["capacity"], header["next"] = size, total
        header["start_realtime_ns"] = first_call - 2_000_000
        header["pid"], header["global_rank"], header["world_size"] = pid, rank, len(trace.ranks) or len(ranks)
        header["local_rank"] = rank % trace.ranks_per_node if trace.ranks_per_node else -1
        header["hostname"], header["sensitivity_ms"] = node.encode()[:63], sensitivity_ms
        path = directory / f"rankwatch-{node}-{pid}.ring"
        with open(path, "wb") as handle:
            handle.write(header.tobytes().ljust(HEADER_SIZE, b"\0"))
            handle.write(slots.tobytes())
        written.append(path)
    return written
