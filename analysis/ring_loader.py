"""Read many ring files into one Trace, optionally with several processes.

Headers first (4 KiB each) to order the rings by rank and size one output array; then each ring is
read whole and its records converted with one structured copy into its slot of that array. With
``workers > 1`` the array lives in an anonymous shared mapping and forked processes fill disjoint
slots (at 16k ranks reading is most of an analysis); what they learn about communicators comes back
as small tuples. Unreadable rings become problems, not failures.
"""

from __future__ import annotations

import mmap
import multiprocessing
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rankwatch.analysis.progress import Progress
from rankwatch.analysis.ring import (
    MAX_GLOBAL_RANK,
    RAW_RECORD,
    RECORD_DTYPE,
    Op,
    RingError,
    RingReader,
    State,
    gpu_in_flight,
    peek_header,
)
from rankwatch.analysis.trace import CALL_DTYPE, Communicator, RankSource, Trace

_RECORD_SOURCES = ("global_rank", "comm_id", "seq", "op", "count", "dtype", "peer", "rank", "nranks", "t_call_ns",
                   "t_return_ns", "gpu_start_ns", "gpu_end_ns", "group_id")  # fmt: skip
# The calls' fields where a ring record keeps them: converting a record is one structured copy.
_RECORD_AS_CALL = np.dtype(
    {
        "names": list(CALL_DTYPE.names),
        "formats": [CALL_DTYPE[name] for name in CALL_DTYPE.names],
        "offsets": [RECORD_DTYPE.fields[source][1] for source in _RECORD_SOURCES],
        "itemsize": RECORD_DTYPE.itemsize,
    }
)
RAW_CALL = np.dtype((np.void, CALL_DTYPE.itemsize))

_output: np.ndarray | None = None  # the shared output array, inherited by forked workers


@dataclass
class _RingRead:
    """What reading one ring found, besides the calls written into the output."""

    rank: int
    path: str
    offset: int
    count: int = 0
    hostname: str = "unknown"
    pid: int = -1
    world_size: int | None = None
    gpu_index: int | None = None
    gpu_uuid: str | None = None
    readable: bool = True
    problem: str | None = None
    created: list[tuple[int, int, int, int]] = field(default_factory=list)  # comm, rank in it, size, parent
    from_calls: list[tuple[int, int, int]] = field(default_factory=list)  # comm, rank in it, size


def _read_one(rank: int, path: str, offset: int) -> _RingRead:
    result = _RingRead(rank, path, offset)
    try:
        with RingReader(path, load=True) as reader:
            snapshot = reader.read()
    except RingError as error:
        result.problem, result.readable = str(error), False
        return result
    records = snapshot.records
    result.hostname, result.pid = snapshot.header.hostname, snapshot.header.pid
    result.world_size = snapshot.header.world_size if snapshot.header.world_size > 0 else None
    result.gpu_index, result.gpu_uuid = snapshot.header.gpu_index, snapshot.header.gpu_uuid
    if snapshot.torn:
        result.problem = f"{path}: {snapshot.torn} torn or in-flight records skipped"
    rejected = records["state"] == State.FAILED  # NCCL returned an error at once: no operation took place
    if rejected.any():
        note = f"{path}: {int(rejected.sum())} calls NCCL refused (an error result) not analysed"
        result.problem = f"{result.problem}; {note}" if result.problem else note
        records = records[~rejected]
    op = records["op"]
    traced = (op > Op.NONE) & (op < Op.COMM_INIT)
    lifecycle = np.flatnonzero(~traced)
    if len(lifecycle):
        events = records[lifecycle]
        creation = events["op"] <= Op.COMM_SHRINK
        columns = (events[name][creation].tolist() for name in ("comm_id", "rank", "nranks", "aux"))
        result.created = list(zip(*columns, strict=True))
        if lifecycle[-1] == len(lifecycle) - 1:  # creations first, as usual: a slice, no copy
            records = records[len(lifecycle) :]
        else:
            records = records.view(RAW_RECORD)[traced].view(RECORD_DTYPE)
    created = {comm_id for comm_id, *_ in result.created}
    # One sort for every communicator's first call (a search per communicator was quadratic in a ring of
    # many communicators).
    unique_ids, first_rows = np.unique(records["comm_id"], return_index=True)
    for comm_id, row in zip(unique_ids.tolist(), first_rows.tolist(), strict=True):
        if comm_id not in created:  # its creation fell out of a wrapped ring: its first call tells its place
            first = records[row]
            result.from_calls.append((comm_id, int(first["rank"]), int(first["nranks"])))
    # A GPU-timed call is over when its GPU work ended: the host call of an asynchronous GPU returns at
    # once, so one whose GPU work has not ended is still in flight (t_return 0), as on a synchronous one.
    gpu_pending = gpu_in_flight(records)  # in claim order: a stream runs its work in that order
    if len(records) > 1 and (np.diff(records["t_call_ns"]) < 0).any():  # threads interleaved
        by_call = np.argsort(records["t_call_ns"], kind="stable")
        records, gpu_pending = records[by_call], gpu_pending[by_call]
    assert _output is not None
    out = _output[offset : offset + len(records)]
    out[:] = records.view(_RECORD_AS_CALL)
    out["rank"] = rank  # the header's word, as for the communicators
    if gpu_pending.any():
        out["t_return"][gpu_pending] = 0
    result.count = len(records)
    return result


def _read_chunk(chunk: list[tuple[int, str, int]]) -> list[_RingRead]:
    return [_read_one(*ring) for ring in chunk]


def load_rings(paths: Iterable[str | Path], workers: int = 1) -> Trace:
    """Read ring files (one per process) into one Trace sorted by rank and call time."""
    global _output
    problems: list[str] = []
    skipped: list[str] = []
    chosen: list[tuple[int, str, int]] = []  # rank, path, where its calls go
    first_path: dict[int, Path] = {}
    upper = 0
    headers: list[tuple[int, Path, int]] = []
    for path in sorted(map(Path, paths)):
        try:
            rank, held = peek_header(path)
        except RingError as error:
            skipped.append(str(error))
            continue
        if rank < 0:
            skipped.append(f"{path}: the ring does not say its global rank (RANK was unset); skipped")
        elif rank > MAX_GLOBAL_RANK:
            skipped.append(
                f"{path}: global rank {rank} is beyond the highest rankwatch analyses ({MAX_GLOBAL_RANK}); skipped"
            )
        elif rank in first_path:
            problems.append(f"{path}: rank {rank} also comes from {first_path[rank]}; kept the first")
        else:
            first_path[rank] = path
            headers.append((rank, path, held))
    for rank, path, held in sorted(headers):
        chosen.append((rank, str(path), upper))
        upper += held
    size = max(upper, 1) * CALL_DTYPE.itemsize
    shared = workers > 1 and len(chosen) >= 2 * workers
    _output = np.frombuffer(mmap.mmap(-1, size), CALL_DTYPE) if shared else np.empty(upper, CALL_DTYPE)
    try:
        if shared:
            chunks = [chosen[i :: workers * 8] for i in range(workers * 8)]  # interleaved: even work
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
                results = sorted((r for part in pool.map(_read_chunk, chunks) for r in part), key=lambda r: r.rank)
        else:
            progress = Progress(len(chosen), "reading rings")
            results = []
            for ring in chosen:
                progress.advance()
                results.append(_read_one(*ring))
            progress.close()
        calls = _output
    finally:
        _output = None
    return _assemble(calls, results, problems, skipped)


def _assemble(calls: np.ndarray, results: list[_RingRead], problems: list[str], skipped: list[str]) -> Trace:
    """Close the gaps between the rings' calls (slots were sized from the headers) and learn the
    communicators: creation records first, then what calls tell of the others."""
    ranks: dict[int, RankSource] = {}
    comms: dict[int, Communicator] = {}
    raw = calls.view(RAW_CALL)
    filled = 0
    problems.extend(skipped)
    for result in results:
        if result.problem:
            problems.append(result.problem)
        if not result.readable:
            skipped.append(result.problem or result.path)
            continue
        if result.offset != filled and result.count:  # overlapping moves are safe: numpy copies through a buffer
            raw[filled : filled + result.count] = raw[result.offset : result.offset + result.count]
        filled += result.count
        ranks[result.rank] = RankSource(
            result.rank, result.hostname, result.pid, result.path, result.world_size, result.gpu_index, result.gpu_uuid
        )
        for comm_id, comm_rank, size, parent in result.created:
            comm = comms.setdefault(comm_id, Communicator(comm_id, size))
            comm.members[comm_rank] = result.rank
            comm.parent = parent
    for result in results:
        for comm_id, comm_rank, size in result.from_calls:
            comm = comms.setdefault(comm_id, Communicator(comm_id, size))
            comm.members.setdefault(comm_rank, result.rank)
    return Trace(calls[:filled], ranks, comms, problems, skipped=skipped)
