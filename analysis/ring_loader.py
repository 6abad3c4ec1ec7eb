"""Read many ring files into one Trace, optionally with several processes.

Headers first (4 KiB each) to order the rings by rank and size the output columns (one array per
field of the calls, ``Calls``); then the rings' windows of records are read back to back into a batch
buffer (8 MiB), and each batch is checked and converted with one pass per column into the rings'
slots of those columns: no per-record Python, and the memory beyond the output is one batch. With
``workers > 1`` the columns live in an anonymous shared mapping and forked processes fill disjoint
slots (at 16k ranks reading is most of an analysis); what they learn about communicators comes back
as small tuples. Unreadable rings become problems, not failures.
"""

from __future__ import annotations

import itertools
import mmap
import multiprocessing
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from rankwatch.analysis.progress import Progress
from rankwatch.analysis.ring import (
    HEADER_DTYPE,
    HEADER_SIZE,
    MAX_GLOBAL_RANK,
    RAW_RECORD,
    RECORD_DTYPE,
    RECORD_SIZE,
    Flag,
    Op,
    RingError,
    State,
    gpu_in_flight,
    gpu_of,
    peek_header,
    take,
    validate_ring,
)
from rankwatch.analysis.trace import CALL_DTYPE, Calls, Communicator, RankSource, Trace

# Where a ring record keeps each field of the calls (the rank comes from the ring's header)
_RECORD_SOURCE = {"comm": "comm_id", "seq": "seq", "op": "op", "count": "count", "dtype": "dtype", "peer": "peer",
                  "comm_rank": "rank", "comm_size": "nranks", "t_call": "t_call_ns", "t_return": "t_return_ns",
                  "gpu_start": "gpu_start_ns", "gpu_end": "gpu_end_ns", "group": "group_id"}  # fmt: skip

_output: Calls | None = None  # the output columns (in a shared mapping with workers), inherited by forked workers


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


BATCH_RECORDS = 1 << 16
"""Records (8 MiB) read before they are converted together: the per-ring work is a file read, the
memory beyond the output stays one batch whatever the number of rings, and the passes over a batch
(one per column) find it in the processor's cache."""


@dataclass
class _Batch:
    """Rings read back to back into one buffer of records in claim order."""

    reads: list[_RingRead]
    buffer: np.ndarray  # RAW_RECORD
    counts: list[int]  # records read from each ring (0 for one that could not be read)
    firsts: list[int]  # the claim index of each ring's first record read


class _Scratch:
    """Buffers reused from batch to batch: fresh ones of 64 MiB each time cost more in page faults
    (system time) than the conversion itself."""

    def __init__(self) -> None:
        self.records = np.empty(0, RAW_RECORD)

    def sized(self, records: int) -> None:
        if len(self.records) < records:
            self.records = np.empty(max(records, BATCH_RECORDS), RAW_RECORD)


def _read_records(handle: BinaryIO, into: memoryview, slot: int, count: int) -> None:
    handle.seek(HEADER_SIZE + slot * RECORD_SIZE)
    if handle.readinto(into) != count * RECORD_SIZE:
        raise RingError(f"{handle.name}: shorter than its header promises (changed while read)")


def _read_batch(rings: list[tuple[int, str, int, int]], buffer: np.ndarray) -> _Batch:
    """Each ring's window of claims (at most what its slot holds: the newest), straight into ``buffer``."""
    raw = memoryview(buffer.view(np.uint8))
    batch, filled = _Batch([], buffer, [], []), 0
    for rank, path, offset, held in rings:
        result = _RingRead(rank, path, offset)
        batch.reads.append(result)
        count = first = 0
        try:
            with open(path, "rb") as handle:
                head, size = handle.read(HEADER_SIZE), os.fstat(handle.fileno()).st_size
                capacity = validate_ring(path, head, size)
                header = np.frombuffer(head, HEADER_DTYPE, count=1)[0]
                claimed = int(header["next"])
                count = min(claimed, capacity, held)
                first = claimed - count
                start = first % capacity
                ahead = min(count, capacity - start)  # the window is at most two runs of slots
                at = filled * RECORD_SIZE
                _read_records(handle, raw[at : at + ahead * RECORD_SIZE], start, ahead)
                if count > ahead:
                    at += ahead * RECORD_SIZE
                    _read_records(handle, raw[at : at + (count - ahead) * RECORD_SIZE], 0, count - ahead)
        except RingError as error:
            result.problem, result.readable, count = str(error), False, 0
        except OSError as error:
            result.problem, result.readable, count = f"{path}: cannot read: {error}", False, 0
        else:
            result.hostname = bytes(header["hostname"]).split(b"\0", 1)[0].decode(errors="replace")
            result.pid = int(header["pid"])
            result.world_size = int(header["world_size"]) if header["world_size"] > 0 else None
            gpu = gpu_of(header)
            result.gpu_index, result.gpu_uuid = gpu.get("gpu_index"), gpu.get("gpu_uuid")  # type: ignore[assignment]
        batch.counts.append(count)
        batch.firsts.append(first)
        filled += count
    batch.buffer = buffer[:filled]
    return batch


def _note(result: _RingRead, note: str) -> None:
    result.problem = f"{result.problem}; {note}" if result.problem else note


def _convert_batch(batch: _Batch, output: Calls, start: int) -> int:
    """The batch's records as calls in ``output`` from row ``start`` on, back to back in ring order,
    with one pass per column over the whole batch; Python only for the few rings with something to say
    (torn or refused records, communicator creations, calls still on the GPU, threads whose calls
    interleaved). Returns where the next batch's calls go."""
    counts = np.array(batch.counts, np.int64)
    starts = np.r_[0, np.cumsum(counts)]
    ring_of = np.repeat(np.arange(len(counts)), counts)
    records = batch.buffer.view(RECORD_DTYPE)
    claims = np.arange(len(records), dtype=np.int64) + np.repeat(np.array(batch.firsts, np.int64) - starts[:-1], counts)
    valid = records["stamp"] == claims.astype(np.uint64) * np.uint64(2) + np.uint64(2)
    rejected = valid & (records["state"] == State.FAILED)  # NCCL returned an error at once: no operation took place
    op = records["op"]
    traced = (op > Op.NONE) & (op < Op.COMM_INIT)
    torn = np.bincount(ring_of[~valid], minlength=len(counts))
    refused = np.bincount(ring_of[rejected], minlength=len(counts))
    for index in np.flatnonzero(torn | refused).tolist():
        result = batch.reads[index]
        if torn[index]:
            _note(result, f"{result.path}: {torn[index]} torn or in-flight records skipped")
        if refused[index]:
            _note(result, f"{result.path}: {refused[index]} calls NCCL refused (an error result) not analysed")
    kept = valid & ~rejected
    creations = np.flatnonzero(kept & ~traced & (op <= Op.COMM_SHRINK))
    if len(creations):
        events = records[creations]
        fields = (events[name].tolist() for name in ("comm_id", "rank", "nranks", "aux"))
        for index, *created in zip(ring_of[creations].tolist(), *fields, strict=True):
            batch.reads[index].created.append(tuple(created))  # type: ignore[arg-type]
    is_call = kept & traced
    _communicators_from_calls(batch, records, is_call, ring_of)
    ranks = np.array([result.rank for result in batch.reads], np.int32)
    written = np.bincount(ring_of[is_call], minlength=len(counts))
    ends = start + np.cumsum(written)
    offsets = ends - written  # where each ring's calls begin
    own = output[start : int(ends[-1])] if len(ends) else output[:0]  # views of the columns
    call_rings = ring_of[is_call]
    own["rank"] = ranks[call_rings]  # the header's word, as for the communicators
    for name, source in _RECORD_SOURCE.items():  # a mask then a copy: twice as fast as a scatter
        own[name] = records[source][is_call]
    for result, offset, count in zip(batch.reads, offsets.tolist(), written.tolist(), strict=True):
        result.offset, result.count = offset, count
    # A GPU-timed call is over when its GPU work ended: the host call of an asynchronous GPU returns at
    # once, so one whose GPU work has not ended is still in flight (t_return 0), as on a synchronous one.
    maybe_pending = is_call & ((records["flags"] & Flag.GPU_TIMED) != 0) & (records["state"] == State.RETURNED)
    maybe_pending &= records["gpu_end_ns"] == 0
    for index in np.unique(ring_of[maybe_pending]).tolist():
        rows = starts[index] + np.flatnonzero(is_call[starts[index] : starts[index + 1]])
        pending = gpu_in_flight(take(records, rows))  # in claim order: a stream runs its work in that order
        own["t_return"][offsets[index] - start + np.flatnonzero(pending)] = 0
    t_call = own["t_call"]
    backwards = np.flatnonzero((t_call[1:] < t_call[:-1]) & (call_rings[1:] == call_rings[:-1]))
    for index in np.unique(call_rings[backwards]).tolist():  # threads interleaved: sorted by call time
        ring_calls = output[offsets[index] : offsets[index] + written[index]]
        order = np.argsort(ring_calls["t_call"], kind="stable")
        for name in CALL_DTYPE.names:
            ring_calls[name] = ring_calls[name][order]
    return int(ends[-1]) if len(ends) else start


def _first_of_each(rings: np.ndarray, comms: np.ndarray, passes: int = 8) -> np.ndarray:
    """Positions of the first call of each (ring, communicator), ascending. A ring uses a few
    communicators: one pass per communicator takes each ring's first remaining call and drops the calls
    on the same communicator; whatever remains after ``passes`` (a ring of many) is sorted once."""
    firsts = []
    remaining = np.arange(len(rings))
    head_comm = np.zeros(int(rings.max()) + 1 if len(rings) else 0, comms.dtype)
    for _ in range(passes):
        if not len(remaining):
            break
        ring = rings[remaining]
        head = remaining[np.r_[True, ring[1:] != ring[:-1]]]
        firsts.append(head)
        head_comm[rings[head]] = comms[head]
        remaining = remaining[comms[remaining] != head_comm[ring]]
    if len(remaining):
        order = np.lexsort((comms[remaining], rings[remaining]))  # stable: each pair's first call comes first
        ring, comm = rings[remaining][order], comms[remaining][order]
        firsts.append(remaining[order[np.r_[True, (ring[1:] != ring[:-1]) | (comm[1:] != comm[:-1])]]])
    return np.sort(np.concatenate(firsts)) if firsts else remaining


def _communicators_from_calls(batch: _Batch, records: np.ndarray, is_call: np.ndarray, ring_of: np.ndarray) -> None:
    """Each ring's communicators whose creation fell out of a wrapped ring: their first call tells
    their place."""
    rows = np.flatnonzero(is_call)
    if not len(rows):
        return
    comm = records["comm_id"]
    firsts = rows[_first_of_each(ring_of[rows], comm[rows])]
    created = {(index, comm_id) for index, result in enumerate(batch.reads) for comm_id, *_ in result.created}
    for index, comm_id, rank, size in zip(ring_of[firsts].tolist(), comm[firsts].tolist(),
                                          records["rank"][firsts].tolist(), records["nranks"][firsts].tolist(),
                                          strict=True):  # fmt: skip
        if (index, comm_id) not in created:
            batch.reads[index].from_calls.append((comm_id, rank, size))


def _batches(rings: list[tuple[int, str, int, int]]) -> Iterator[list[tuple[int, str, int, int]]]:
    batch: list[tuple[int, str, int, int]] = []
    held = 0
    for ring in rings:
        if batch and held + ring[3] > BATCH_RECORDS:
            yield batch
            batch, held = [], 0
        batch.append(ring)
        held += ring[3]
    if batch:
        yield batch


def _read_chunk(chunk: list[tuple[int, str, int, int]], progress: Progress | None = None) -> list[_RingRead]:
    """Rings in rank order, their calls back to back from the first one's slot on: a chunk leaves a
    gap only at its end (its rings' creation records and torn ones), closed once all are read."""
    assert _output is not None
    scratch, results = _Scratch(), []
    start = chunk[0][2] if chunk else 0
    for rings in _batches(chunk):
        scratch.sized(sum(held for *_, held in rings))
        batch = _read_batch(rings, scratch.records)
        start = _convert_batch(batch, _output, start)
        results += batch.reads
        if progress:
            progress.advance(len(rings))
    return results


def _contiguous_chunks(rings: list[tuple[int, str, int, int]], count: int) -> list[list[tuple[int, str, int, int]]]:
    """``rings`` (in rank order) cut into at most ``count`` runs holding about as many records each."""
    ends = np.cumsum([held for *_, held in rings])
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, count) / count, side="right") if len(rings) else []
    bounds = [0, *sorted(set(np.asarray(cuts).tolist())), len(rings)]
    return [rings[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def load_rings(paths: Iterable[str | Path], workers: int = 1) -> Trace:
    """Read ring files (one per process) into one Trace sorted by rank and call time."""
    global _output
    problems: list[str] = []
    skipped: list[str] = []
    chosen: list[tuple[int, str, int, int]] = []  # rank, path, where its calls go, how many it holds
    first_path: dict[int, str] = {}
    upper = 0
    headers: list[tuple[int, str, int]] = []
    for path in sorted(map(str, paths)):  # as strings: comparing 16k paths part by part costs seconds
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
        chosen.append((rank, path, upper, held))
        upper += held
    shared = workers > 1 and len(chosen) >= 2 * workers
    _output = _shared_columns(upper) if shared else Calls.empty(upper)
    try:
        if shared:
            chunks = _contiguous_chunks(chosen, workers * 8)  # several a worker: even work
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
                results = [result for part in pool.map(_read_chunk, chunks) for result in part]  # in rank order
        else:
            progress = Progress(len(chosen), "reading rings")
            results = _read_chunk(chosen, progress)
            progress.close()
        calls = _output
    finally:
        _output = None
    return _assemble(calls, results, problems, skipped)


def _shared_columns(rows: int) -> Calls:
    """Columns of ``rows`` calls in one anonymous shared mapping (forked workers fill them)."""
    sizes = [rows * CALL_DTYPE[name].itemsize for name in CALL_DTYPE.names]
    starts = np.r_[0, np.cumsum([-(-size // 8) * 8 for size in sizes])]  # each column 8-byte aligned
    mapping = mmap.mmap(-1, max(int(starts[-1]), 1))
    return Calls({name: np.frombuffer(mapping, CALL_DTYPE[name], rows, int(start))
                  for name, start in zip(CALL_DTYPE.names, starts.tolist(), strict=False)})  # fmt: skip


def _assemble(calls: Calls, results: list[_RingRead], problems: list[str], skipped: list[str]) -> Trace:
    """Close the gaps between the rings' calls (slots were sized from the headers) and learn the
    communicators: creation records first, then what calls tell of the others."""
    ranks: dict[int, RankSource] = {}
    comms: dict[int, Communicator] = {}
    moves: list[tuple[int, int, int]] = []  # (from, to, calls): the chunks' calls, to close the gaps between them
    filled = 0
    problems.extend(skipped)
    for result in results:
        if result.problem:
            problems.append(result.problem)
        if not result.readable:
            skipped.append(result.problem or result.path)
            continue
        if result.count:
            if moves and moves[-1][0] + moves[-1][2] == result.offset:
                moves[-1] = (moves[-1][0], moves[-1][1], moves[-1][2] + result.count)
            else:
                moves.append((result.offset, filled, result.count))
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
    for source, target, count in moves:
        if source != target:  # overlapping moves are safe: numpy copies through a buffer
            for name in CALL_DTYPE.names:
                calls[name][target : target + count] = calls[name][source : source + count]
    return Trace(calls[:filled], ranks, comms, problems, skipped=skipped)
