"""The ring reader against rings built byte by byte: valid, torn, overwritten, foreign, truncated."""

from __future__ import annotations

import gc
import resource
import time
from pathlib import Path

import numpy as np
import pytest

from rankwatch.analysis.ring import HEADER_DTYPE, HEADER_SIZE, RECORD_DTYPE, RingError, RingReader, read_ring
from rankwatch.analysis.ring_loader import load_rings


def write_ring(path: Path, claimed: int, capacity: int = 8, version: int = 1, magic: bytes = b"RWRING\0\0") -> Path:
    header = np.zeros(1, HEADER_DTYPE)
    header["magic"], header["version"], header["header_size"], header["record_size"] = magic, version, 4096, 128
    header["capacity"], header["next"], header["global_rank"], header["hostname"] = capacity, claimed, 3, b"node-a"
    slots = np.zeros(capacity, RECORD_DTYPE)
    for index in range(max(0, claimed - capacity), claimed):
        slot = slots[index % capacity]
        slot["stamp"], slot["seq"], slot["op"], slot["state"] = 2 * index + 2, index + 1, 1, 2
    blob = bytearray(HEADER_SIZE + capacity * 128)
    blob[: HEADER_DTYPE.itemsize] = header.tobytes()
    blob[HEADER_SIZE:] = slots.tobytes()
    path.write_bytes(bytes(blob))
    return path


def set_stamp(path: Path, slot: int, stamp: int) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + slot * 128 : HEADER_SIZE + slot * 128 + 8] = stamp.to_bytes(8, "little")
    path.write_bytes(bytes(data))


def test_reads_records_oldest_first_with_header(tmp_path):
    snapshot = read_ring(write_ring(tmp_path / "r.ring", claimed=5))
    assert snapshot.records["seq"].tolist() == [1, 2, 3, 4, 5]
    assert snapshot.header.global_rank == 3 and snapshot.header.hostname == "node-a"
    assert snapshot.torn == 0 and snapshot.overwritten == 0


def test_wrapped_ring_keeps_the_window_and_counts_the_lost(tmp_path):
    snapshot = read_ring(write_ring(tmp_path / "r.ring", claimed=20, capacity=8))
    assert snapshot.records["seq"].tolist() == list(range(13, 21))
    assert snapshot.overwritten == 12 and snapshot.first_index == 12


def test_record_being_written_or_from_another_claim_is_skipped_and_counted(tmp_path):
    path = write_ring(tmp_path / "r.ring", claimed=6, capacity=8)
    set_stamp(path, 2, 2 * 2 + 1)  # odd: a writer is inside it
    set_stamp(path, 4, 2 * (4 + 8) + 2)  # a later claim's stamp on an older index: torn
    snapshot = read_ring(path)
    assert snapshot.records["seq"].tolist() == [1, 2, 4, 6]
    assert snapshot.torn == 2


def test_since_returns_only_newer_records(tmp_path):
    with RingReader(write_ring(tmp_path / "r.ring", claimed=6)) as reader:
        assert reader.read(since=4).records["seq"].tolist() == [5, 6]
        assert len(reader.read(since=6).records) == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"magic": b"NOTARING"}, r"offset 0: not a rankwatch ring"),
        ({"version": 7}, r"offset 8: ring format version 7; this rankwatch reads versions 1 to 2"),
        ({"capacity": 6}, r"offset 24: capacity 6 is not a power of two"),
    ],
)
def test_foreign_or_future_files_are_refused_with_file_and_offset(tmp_path, kwargs, message):
    path = write_ring(tmp_path / "bad.ring", claimed=2, **kwargs)
    with pytest.raises(RingError, match=message) as error:
        read_ring(path)
    assert str(path) in str(error.value)


def test_truncated_and_empty_files_are_refused(tmp_path):
    path = write_ring(tmp_path / "cut.ring", claimed=2)
    path.write_bytes(path.read_bytes()[: HEADER_SIZE + 100])
    with pytest.raises(RingError, match="truncated"):
        read_ring(path)
    (tmp_path / "empty.ring").write_bytes(b"")
    with pytest.raises(RingError, match=r"cannot map|shorter than a ring header"):
        read_ring(tmp_path / "empty.ring")


def test_progress_line_only_on_a_terminal_and_only_when_slow():
    import io

    from rankwatch.analysis.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    quiet = io.StringIO()
    progress = Progress(3, "reading", stream=quiet, delay=0)
    progress.advance()
    progress.close()
    assert quiet.getvalue() == "", "not a terminal: no progress line"
    screen = Terminal()
    progress = Progress(2, "reading rings", stream=screen, delay=0)
    progress.advance()
    progress.advance()
    progress.close()
    assert screen.getvalue().endswith("reading rings [" + "#" * 30 + "] 2/2\n")
    fast = Terminal()
    progress = Progress(2, "reading", stream=fast, delay=60)
    progress.advance()
    assert fast.getvalue() == "", "reads that take less than the delay show nothing"


def _sparse_header_only(path: Path, capacity: int, claimed: int, rank: int = 3, extra: int = 0) -> Path:
    """A header promising ``capacity`` records, the file extended to fit without writing them (sparse)."""
    header = np.zeros(1, HEADER_DTYPE)
    header["magic"], header["version"], header["header_size"], header["record_size"] = b"RWRING\0\0", 1, 4096, 128
    header["capacity"], header["next"], header["global_rank"] = capacity, claimed, rank
    with open(path, "wb") as out:
        out.write(header.tobytes().ljust(HEADER_SIZE, b"\0"))
        out.truncate(HEADER_SIZE + capacity * 128 + extra)
    return path


def test_a_header_promising_a_huge_ring_is_refused_before_anything_is_read(tmp_path):
    path = _sparse_header_only(tmp_path / "huge.ring", capacity=1 << 32, claimed=1 << 32)  # 512 GiB, sparse
    with pytest.raises(RingError, match=r"offset 24: capacity 4294967296 records is over the largest"):
        read_ring(path)
    trace = load_rings([path])
    assert len(trace.calls) == 0 and "over the largest" in trace.problems[0]


def test_loading_a_ring_reads_what_its_header_promises_not_the_whole_sparse_file(tmp_path):
    ring = write_ring(tmp_path / "r.ring", claimed=5)
    with open(ring, "r+b") as out:
        out.truncate(HEADER_SIZE + 8 * 128 + (8 << 30))  # 8 GiB of sparse tail after the records
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with RingReader(ring, load=True) as reader:
        assert reader.read().records["seq"].tolist() == [1, 2, 3, 4, 5]
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) < 64 << 10  # KiB: under 64 MiB


def test_a_ring_claiming_a_huge_global_rank_is_skipped_with_a_problem(tmp_path):
    ring = write_ring(tmp_path / "r.ring", claimed=5)
    data = bytearray(ring.read_bytes())
    offset = HEADER_DTYPE.fields["global_rank"][1]
    data[offset : offset + 4] = (2**31 - 1).to_bytes(4, "little")
    ring.write_bytes(bytes(data))
    trace = load_rings([ring])
    assert len(trace.calls) == 0 and "global rank 2147483647 is beyond the highest" in trace.problems[0]


def _ring_of_one_communicator_per_record(path: Path, capacity: int) -> Path:
    header = np.zeros(1, HEADER_DTYPE)
    header["magic"], header["version"], header["header_size"], header["record_size"] = b"RWRING\0\0", 1, 4096, 128
    header["capacity"], header["next"], header["global_rank"] = capacity, capacity, 0
    slots = np.zeros(capacity, RECORD_DTYPE)
    slots["stamp"] = np.arange(capacity, dtype=np.uint64) * 2 + 2
    slots["seq"], slots["op"], slots["state"] = 1, 1, 2
    slots["comm_id"] = np.arange(1, capacity + 1, dtype=np.uint64)
    slots["nranks"], slots["t_call_ns"] = 2, np.arange(capacity) * 1000
    path.write_bytes(header.tobytes().ljust(HEADER_SIZE, b"\0") + slots.tobytes())
    return path


def _cpu_seconds_to_load(path: Path, communicators: int) -> float:
    """This thread's CPU time (other processes' load does not add to it, unlike the wall clock), without
    the garbage collector's passes over whatever else the test session holds."""
    gc.collect()
    gc.disable()
    try:
        started = time.thread_time()
        trace = load_rings([path])
        spent = time.thread_time() - started
    finally:
        gc.enable()
    assert len(trace.comms) == communicators
    return spent


def test_a_ring_of_many_communicators_loads_in_linear_time(tmp_path):
    """Every record on a communicator of its own: finding each one's first call was quadratic. Four
    times the communicators cost about four times the CPU (a sort: a little more), where the quadratic
    search cost sixteen; CPU time, not the wall clock, so a busy machine cannot fail it."""
    small, large = 1 << 15, 1 << 17
    small_ring = _ring_of_one_communicator_per_record(tmp_path / "small.ring", small)
    large_ring = _ring_of_one_communicator_per_record(tmp_path / "large.ring", large)
    # the least of three: the first load pays for imports and fresh pages, not for the communicators
    small_cost = min(_cpu_seconds_to_load(small_ring, small) for _ in range(3))
    growth = min(_cpu_seconds_to_load(large_ring, large) for _ in range(3)) / small_cost
    assert growth < 8, f"4x the communicators cost {growth:.1f}x the CPU"
