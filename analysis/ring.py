"""Read rankwatch trace rings (nccl_patch/include/rankwatch_ring.h) in place, as numpy arrays.

A ring is a 4096-byte header and ``capacity`` 128-byte records; record ``i`` lives in slot
``i % capacity`` and is valid when its stamp is ``2*i + 2``. A reader maps the file read-only,
takes the window of the last ``capacity`` claims and keeps the records whose stamp matches their
claim: a stamp that is odd (being written) or from another claim (overwritten, torn) is counted,
never returned, never fatal.
"""

from __future__ import annotations

import enum
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"RWRING\0\0"
SUPPORTED_VERSION = 2
"""The newest ring format this reader understands; it reads every older one too (version 1 rings do not
name their GPU)."""
OLDEST_VERSION = 1
HEADER_GPU_TIMING, HEADER_GPU_KNOWN = 1, 2  # header flags (rankwatch_ring.h: enum rw_header_flags)
HEADER_SIZE = 4096
RECORD_SIZE = 128


class RingError(ValueError):
    """The file is not a ring this reader understands; the message names the file and offset."""


class Op(enum.IntEnum):
    NONE = 0
    ALLREDUCE = 1
    BROADCAST = 2
    REDUCE = 3
    ALLGATHER = 4
    REDUCESCATTER = 5
    ALLTOALL = 6
    GATHER = 7
    SCATTER = 8
    SEND = 9
    RECV = 10
    COMM_INIT = 32
    COMM_SPLIT = 33
    COMM_SHRINK = 34
    COMM_DESTROY = 35
    COMM_ABORT = 36


class State(enum.IntEnum):
    EMPTY = 0
    ENTERED = 1
    RETURNED = 2
    GPU_DONE = 3
    FAILED = 4


class Flag(enum.IntFlag):
    GROUPED = 1
    GPU_TIMED = 2
    GRAPH_CAPTURE = 4
    IN_PROGRESS = 8


RECORD_DTYPE = np.dtype(
    [
        ("stamp", "<u8"),
        ("comm_id", "<u8"),
        ("seq", "<u8"),
        ("count", "<u8"),
        ("stream", "<u8"),
        ("t_call_ns", "<i8"),
        ("t_return_ns", "<i8"),
        ("gpu_start_ns", "<i8"),
        ("gpu_end_ns", "<i8"),
        ("aux", "<u8"),
        ("group_id", "<u8"),
        ("rank", "<i4"),
        ("nranks", "<i4"),
        ("global_rank", "<i4"),
        ("peer", "<i4"),
        ("result", "<i4"),
        ("tid", "<u4"),
        ("op", "u1"),
        ("dtype", "u1"),
        ("redop", "u1"),
        ("state", "u1"),
        ("flags", "<u4"),
        ("reserved", "<u8"),
    ]
)
assert RECORD_DTYPE.itemsize == RECORD_SIZE
RAW_RECORD = np.dtype((np.void, RECORD_SIZE))


def take(records: np.ndarray, selector: np.ndarray) -> np.ndarray:
    """``records[selector]`` (a mask or indices), copied as whole 128-byte rows: numpy copies structured
    records field by field, 10-20x slower, which matters when a sidecar reads millions a second."""
    return records.view(RAW_RECORD)[selector].view(RECORD_DTYPE)


def gpu_in_flight(records: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
    """Mask of GPU-timed calls that returned on the host and whose GPU work has not ended: in flight on an
    asynchronous GPU, whose host call returns at once. ``order``: each record's claim index (default: the
    array order), since a stream runs its work in claim order.

    A call is over once its GPU end is written (whatever the state says: the library may publish the end
    just before the host return) or once a later call on the same stream, outside its NCCL group, started
    on the GPU: that start came after this call's end. Without the second rule a lost end (its timing
    event never read) would keep an old call in flight for ever, and a healthy job would look hung."""
    timed = (records["flags"] & Flag.GPU_TIMED) != 0
    pending = timed & (records["state"] == State.RETURNED) & (records["gpu_end_ns"] == 0)
    if not pending.any():
        return pending
    order = np.arange(len(records), dtype=np.uint64) if order is None else order.astype(np.uint64, copy=False)
    started = timed & ((records["gpu_start_ns"] > 0) | (records["gpu_end_ns"] > 0))
    if not started.any():
        return pending
    streams, groups = records["stream"], records["group_id"]
    for stream in np.unique(streams[pending]).tolist():  # a few streams per process
        on = streams == stream
        ranked = np.where(started & on, order + np.uint64(1), np.uint64(0))  # 0: not a started call there
        latest = int(np.argmax(ranked))
        if not ranked[latest]:
            continue
        rows = np.flatnonzero(pending & on)
        group = groups[latest]
        over = (order[rows] < order[latest]) & ((groups[rows] != group) | (groups[rows] == 0))
        pending[rows[over]] = False
    return pending


HEADER_DTYPE = np.dtype(
    [
        ("magic", "S8"),
        ("version", "<u4"),
        ("header_size", "<u4"),
        ("record_size", "<u4"),
        ("flags", "<u4"),
        ("capacity", "<u8"),
        ("next", "<u8"),
        ("start_realtime_ns", "<i8"),
        ("start_monotonic_ns", "<i8"),
        ("pid", "<i4"),
        ("global_rank", "<i4"),
        ("local_rank", "<i4"),
        ("world_size", "<i4"),
        ("nccl_version", "<i4"),
        ("lost_updates", "<u4"),
        ("hostname", "S64"),
        ("job", "S64"),
        ("sensitivity_ms", "<i4"),
        ("gpu_skipped", "<u4"),
        ("gpu_clock_error_ns", "<i8"),
        ("gpu_index", "<i4"),  # version 2
        ("gpu_uuid", "u1", (16,)),  # version 2
    ]
)
assert HEADER_DTYPE.fields["gpu_uuid"][1] == 228  # rankwatch_ring.h asserts the same offset


@dataclass(frozen=True)
class RingHeader:
    path: Path
    version: int
    capacity: int
    claimed: int
    pid: int
    global_rank: int
    local_rank: int
    world_size: int
    hostname: str
    job: str
    start_realtime_ns: int
    nccl_version: int
    sensitivity_ms: int
    gpu_timing: bool
    lost_updates: int
    gpu_skipped: int
    start_monotonic_ns: int = 0
    gpu_clock_error_ns: int = 0  # how far GPU times may be off against host times (the clock anchor's window)
    gpu_index: int | None = None  # the CUDA device ordinal, when the ring names it (version 2, once known)
    gpu_uuid: str | None = None  # ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``, as nvidia-smi prints it

    @property
    def gpu(self) -> str | None:
        """``GPU 3 (GPU-5f1c…)``, as much as the ring knows; None when it does not."""
        if self.gpu_index is None:
            return None
        return f"GPU {self.gpu_index}" + (f" ({self.gpu_uuid})" if self.gpu_uuid else "")


@dataclass(frozen=True)
class RingSnapshot:
    """The valid records of one read, oldest first, and what was skipped."""

    header: RingHeader
    records: np.ndarray  # RECORD_DTYPE, a copy: stable after the ring moves on
    first_index: int  # claim index of the oldest slot in the window
    torn: int  # slots in the window being written, overwritten or torn at read time
    overwritten: int  # claims older than the window (lost to wrap-around)


MAX_CAPACITY = 1 << 24
"""Largest ring this reader takes: 16 Mi records, 2 GiB (the library's default is 64 Ki records). A header
may promise any capacity; a sparse file can back it without using the disk."""
MAX_GLOBAL_RANK = (1 << 20) - 1
"""Highest global rank the readers take: far beyond any job, and small enough that per-rank arrays
indexed by rank (the analysis has some) stay small."""


def validate_ring(path: str | Path, head: bytes, size: int) -> int:
    """The ring's capacity, once its header shows a ring this reader understands."""
    if size < HEADER_SIZE:
        raise RingError(f"{path}: {size} bytes is shorter than a ring header ({HEADER_SIZE})")
    header = np.frombuffer(head, HEADER_DTYPE, count=1)[0]
    if bytes(header["magic"]).ljust(8, b"\0") != MAGIC:
        raise RingError(f"{path}: offset 0: not a rankwatch ring (magic {bytes(header['magic'])!r})")
    if not OLDEST_VERSION <= header["version"] <= SUPPORTED_VERSION:
        raise RingError(
            f"{path}: offset 8: ring format version {int(header['version'])}; this rankwatch reads "
            f"versions {OLDEST_VERSION} to {SUPPORTED_VERSION} (upgrade rankwatch to read newer rings)"
        )
    if header["record_size"] != RECORD_SIZE or header["header_size"] != HEADER_SIZE:
        raise RingError(
            f"{path}: offset 12: header/record size {int(header['header_size'])}/"
            f"{int(header['record_size'])}, expected {HEADER_SIZE}/{RECORD_SIZE}"
        )
    capacity = int(header["capacity"])
    if capacity <= 0 or capacity & (capacity - 1):
        raise RingError(f"{path}: offset 24: capacity {capacity} is not a power of two")
    if capacity > MAX_CAPACITY:
        raise RingError(
            f"{path}: offset 24: capacity {capacity} records is over the largest this reader takes ({MAX_CAPACITY})"
        )
    expected = HEADER_SIZE + capacity * RECORD_SIZE
    if size < expected:
        raise RingError(f"{path}: truncated: {size} bytes, the header promises {expected}")
    return capacity


def peek_header(path: str | Path) -> tuple[int, int]:
    """(global rank, records held) from the header alone: 4 KiB read, the same checks as a reader (the
    path as given: 16k of them made into ``Path`` objects cost a second)."""
    try:
        with open(path, "rb") as handle:
            head, size = handle.read(HEADER_SIZE), os.fstat(handle.fileno()).st_size
    except OSError as error:
        raise RingError(f"{path}: cannot read: {error}") from error
    capacity = validate_ring(path, head, size)
    header = np.frombuffer(head, HEADER_DTYPE, count=1)[0]
    return int(header["global_rank"]), min(int(header["next"]), capacity)


def gpu_of(header: np.void) -> dict[str, int | str | None]:
    """gpu_index / gpu_uuid of a header that names its GPU (version 2 with the flag set), else none."""
    if header["version"] < 2 or not int(header["flags"]) & HEADER_GPU_KNOWN:
        return {}
    raw = bytes(header["gpu_uuid"])
    uuid = None
    if any(raw):
        text = raw.hex()
        uuid = f"GPU-{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"
    return {"gpu_index": int(header["gpu_index"]), "gpu_uuid": uuid}


class RingReader:
    """One ring file, mapped read-only; ``read()`` can be called again as the ring grows."""

    def __init__(self, path: str | Path, load: bool = False) -> None:
        """``load``: read the file once into memory instead of mapping it (a finished ring read once)."""
        self.path = Path(path)
        try:
            with open(self.path, "rb") as handle:
                head, size = handle.read(HEADER_SIZE), os.fstat(handle.fileno()).st_size
                self.capacity = validate_ring(self.path, head, size)
                if load:  # what the header promises, not the whole file (which may be larger, or sparse)
                    self._map: mmap.mmap | bytes = head + handle.read(self.capacity * RECORD_SIZE)
                else:
                    self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as error:
            raise RingError(f"{self.path}: cannot map: {error}") from error
        self.capacity = validate_ring(self.path, self._map[:HEADER_SIZE], len(self._map))
        self._header = np.frombuffer(self._map, HEADER_DTYPE, count=1, offset=0)
        self._slots = np.frombuffer(self._map, RECORD_DTYPE, count=self.capacity, offset=HEADER_SIZE)
        # copies through an opaque 128-byte type are one memcpy; a structured copy goes field by field
        self._raw = np.frombuffer(self._map, RAW_RECORD, count=self.capacity, offset=HEADER_SIZE)

    def header(self) -> RingHeader:
        h = self._header[0]
        return RingHeader(
            path=self.path,
            version=int(h["version"]),
            capacity=self.capacity,
            claimed=int(h["next"]),
            pid=int(h["pid"]),
            global_rank=int(h["global_rank"]),
            local_rank=int(h["local_rank"]),
            world_size=int(h["world_size"]),
            hostname=bytes(h["hostname"]).split(b"\0", 1)[0].decode(errors="replace"),
            job=bytes(h["job"]).split(b"\0", 1)[0].decode(errors="replace"),
            start_realtime_ns=int(h["start_realtime_ns"]),
            nccl_version=int(h["nccl_version"]),
            sensitivity_ms=int(h["sensitivity_ms"]),
            gpu_timing=bool(int(h["flags"]) & HEADER_GPU_TIMING),
            lost_updates=int(h["lost_updates"]),
            gpu_skipped=int(h["gpu_skipped"]),
            start_monotonic_ns=int(h["start_monotonic_ns"]),
            gpu_clock_error_ns=int(h["gpu_clock_error_ns"]),
            **gpu_of(h),
        )

    @property
    def claimed(self) -> int:
        """Records ever claimed by the writer (the header's ``next``), read without building a header."""
        return int(self._header["next"][0])

    def header_bytes(self) -> bytes:
        """A copy of the whole 4096-byte header, as the writer left it."""
        return bytes(self._map[:HEADER_SIZE])

    def records_at(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the slots of claims ``indices`` (uint64) and a mask of those that hold exactly that
        claim, complete, before and after the copy (the rest are being written, overwritten or torn)."""
        slots_of = (indices % np.uint64(self.capacity)).astype(np.int64)
        slots = self._raw[slots_of].view(RECORD_DTYPE)  # one copy of just these slots
        # A record copied while being rewritten is caught by re-reading its stamp after the copy.
        stamps_after = self._slots["stamp"][slots_of]
        expected = indices * np.uint64(2) + np.uint64(2)
        return slots, (slots["stamp"] == expected) & (stamps_after == expected)

    def read(self, since: int = 0) -> RingSnapshot:
        """Valid records with claim index >= ``since``, oldest first (vectorised, one copy)."""
        header = self.header()
        claimed = header.claimed
        first = max(claimed - self.capacity, since, 0)
        if first >= claimed:
            empty = np.empty(0, RECORD_DTYPE)
            return RingSnapshot(header, empty, first, 0, max(0, claimed - self.capacity - since))
        # the window is at most two contiguous runs of slots: copy them, no per-record indexing
        start, count = first % self.capacity, claimed - first
        head = min(count, self.capacity - start)
        slots = np.concatenate([self._raw[start : start + head], self._raw[: count - head]]).view(RECORD_DTYPE)
        # A record copied while being rewritten is caught by re-reading its stamp after the copy.
        stamps_after = np.concatenate(
            [self._slots["stamp"][start : start + head], self._slots["stamp"][: count - head]]
        )
        expected = np.arange(first, claimed, dtype=np.uint64) * np.uint64(2) + np.uint64(2)
        valid = (slots["stamp"] == expected) & (stamps_after == expected)
        overwritten = max(0, claimed - self.capacity - since) if since < claimed - self.capacity else 0
        torn = count - int(np.count_nonzero(valid))
        kept = slots if not torn else slots.view(RAW_RECORD)[valid].view(RECORD_DTYPE)
        return RingSnapshot(header, kept, first, torn, overwritten)

    def close(self) -> None:
        self._slots = None  # type: ignore[assignment]
        self._raw = None  # type: ignore[assignment]
        self._header = None  # type: ignore[assignment]
        if isinstance(self._map, mmap.mmap):
            self._map.close()

    def __enter__(self) -> RingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_ring(path: str | Path) -> RingSnapshot:
    with RingReader(path) as reader:
        return reader.read()
