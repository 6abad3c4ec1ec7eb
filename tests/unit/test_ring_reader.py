"""The ring reader against rings built byte by byte: valid, torn, overwritten, foreign, truncated."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rankwatch.analysis.ring import HEADER_DTYPE, HEADER_SIZE, RECORD_DTYPE, RingError, RingReader, read_ring


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
        ({"version": 7}, r"offset 8: ring format version 7; this rankwatch reads version 1"),
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
