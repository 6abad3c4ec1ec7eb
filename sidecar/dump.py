"""On-demand dumps of the raw records the sidecar keeps in the rings (for deep analysis).

Binary form: one complete ring image per ring, concatenated: the ring's own 4096-byte header
(pid, rank, host name, job, sensitivity as written by the tracer) followed by its records,
renumbered from 0 so that each image is a valid ring file that ``RingReader`` and ``rankwatch
analyze`` read as is (capacity: the next power of two; ``next``: the record count). ``split_dump``
cuts a response back into images; the ``X-Rankwatch-Dump-Ranges`` header gives each ring's original
claim range (``<ring>=<first>-<next>,...``: ask ``since=<next>`` for what came after). JSON form:
the same records as objects with their claim index.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rankwatch.analysis.ring import HEADER_DTYPE, HEADER_SIZE, RECORD_DTYPE, RECORD_SIZE
from rankwatch.protocol import OP_NAMES, ProtocolError
from rankwatch.sidecar.ring_tail import RingTail


def select(tail: RingTail, since: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """The last ``limit`` complete records with claim index >= ``since`` and their claim indices."""
    claimed = tail.reader.claimed
    first = max(since, claimed - tail.capacity, claimed - limit, 0)
    claims = np.arange(first, max(first, claimed), dtype=np.uint64)
    records, valid = tail.reader.records_at(claims)
    return records[valid], claims[valid]


def ring_image(tail: RingTail, records: np.ndarray) -> bytes:
    count = len(records)
    capacity = 1 << max(0, (count - 1).bit_length())
    raw = bytearray(tail.reader.header_bytes())
    header = np.frombuffer(raw, HEADER_DTYPE, count=1)  # a writable view of the copy
    header["capacity"], header["next"] = capacity, count
    slots = np.zeros(capacity, RECORD_DTYPE)
    slots[:count] = records
    slots["stamp"][:count] = np.arange(count, dtype=np.uint64) * np.uint64(2) + np.uint64(2)
    return bytes(raw) + slots.tobytes()


def split_dump(body: bytes) -> list[bytes]:
    """The ring images of a binary dump; ProtocolError when the body is not one."""
    images, offset = [], 0
    while offset < len(body):
        if len(body) - offset < HEADER_SIZE:
            raise ProtocolError(f"dump: {len(body) - offset} bytes at offset {offset} are less than a ring header")
        header = np.frombuffer(body, HEADER_DTYPE, count=1, offset=offset)[0]
        size = HEADER_SIZE + int(header["capacity"]) * RECORD_SIZE
        if offset + size > len(body):
            raise ProtocolError(
                f"dump: the ring image at offset {offset} claims {size} bytes; {len(body) - offset} left"
            )
        images.append(body[offset : offset + size])
        offset += size
    return images


def records_json(tail: RingTail, records: np.ndarray, claims: np.ndarray) -> dict[str, Any]:
    header = tail.header
    names = [name for name in RECORD_DTYPE.names if name not in ("stamp", "reserved")]
    rows = []
    for index, values in zip(claims.tolist(), records[names].tolist(), strict=True):
        row = dict(zip(names, values, strict=True))
        row["index"] = index
        row["comm_id"] = f"{row['comm_id']:016x}"
        row["aux"] = f"{row['aux']:016x}"
        row["op"] = OP_NAMES.get(row["op"], str(row["op"]))
        rows.append(row)
    return {
        "ring": tail.name,
        "pid": header.pid,
        "global_rank": header.global_rank,
        "local_rank": header.local_rank,
        "hostname": header.hostname,
        "job": header.job,
        "capacity": tail.capacity,
        "next": int(tail.reader.claimed),
        "records": rows,
    }
