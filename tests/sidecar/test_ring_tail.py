"""Following rings: each record read once, calls seen to finish, torn / wrapped / corrupt survived,
a restarted process's new ring kept apart from its old one."""

from __future__ import annotations

import os
import time

import numpy as np

from rankwatch.analysis.ring import HEADER_SIZE, Op, read_ring
from rankwatch.sidecar.progress import RankProgress
from rankwatch.sidecar.ring_tail import ProcessProbe, RingSet, RingTail


def test_every_record_of_real_rings_is_read_once_and_dead_writers_rings_end(trace_dir):
    rings = RingSet(trace_dir)
    first = rings.poll()
    assert len(first) == 4 and not any(r.ended for r in first), "the first poll reads, it does not end"
    for ring in first:
        expected = read_ring(ring.tail.path).records
        assert np.array_equal(ring.batch.entered, expected)
        assert len(ring.batch.finished) == len(expected), "the run finished: every call is over"
        assert ring.batch.torn == ring.batch.overwritten == 0
        assert not ring.alive, "the simulated processes have exited"
    second = rings.poll()
    assert all(r.ended and len(r.batch.entered) == 0 for r in second)
    assert rings.tails == {} and rings.poll() == [], "ended rings are not read again"


def test_a_live_ring_is_tailed_incrementally_and_calls_are_seen_to_finish(tmp_path, ring_writer):
    writer = ring_writer(tmp_path / "rankwatch-n-1.ring", rank=1, pid=os.getpid())
    writer.call()
    open_call = writer.call(finish=False)
    tail = RingTail(writer.path)
    progress = RankProgress(tail)
    batch = tail.poll()
    progress.update(batch)
    assert batch.entered["seq"].tolist() == [1, 2] and batch.finished["seq"].tolist() == [1]
    [comm] = progress.position(time.time_ns(), True, None).comms
    assert (comm.comm_id, comm.last_entered, comm.last_completed) == ("0000000000c0ffee", 2, 1)
    assert (comm.in_flight, comm.oldest_in_flight_seq, comm.oldest_in_flight_op) == (1, 2, "AllReduce")
    assert len(tail.pending) == 1 and ProcessProbe().alive(tail.header)

    writer.call()
    writer.finish(open_call, wait_ns=5_000_000)
    batch = tail.poll()
    progress.update(batch)
    assert batch.entered["seq"].tolist() == [3], "only the new claim is first seen"
    assert sorted(batch.finished["seq"].tolist()) == [2, 3], "the open call finished, with its return time"
    assert int(batch.finished[batch.finished["seq"] == 2]["t_return_ns"][0]) > 0
    [comm] = progress.position(time.time_ns(), True, None).comms
    assert comm.last_completed == 3 and comm.in_flight == 0 and len(tail.pending) == 0
    assert len(tail.poll().entered) == 0
    writer.close()


def test_torn_and_wrapped_records_are_counted_not_fatal(tmp_path, ring_writer):
    writer = ring_writer(tmp_path / "rankwatch-n-2.ring", rank=2, pid=os.getpid(), capacity=64)
    tail = RingTail(writer.path)
    for _ in range(3):
        writer.call()
    index = writer.call()
    writer.slots["stamp"][index % 64] = 2 * index + 1  # a writer is inside it (or died there)
    batch = tail.poll()
    assert batch.entered["seq"].tolist() == [1, 2, 3] and batch.torn == 0, "being written: retried next poll"
    batch = tail.poll()
    assert len(batch.entered) == 0 and batch.torn == 1, "still odd a poll later: counted torn"

    for _ in range(200):  # wraps the 64-slot ring three times over
        writer.call()
    batch = tail.poll()
    assert len(batch.entered) == 64 and batch.overwritten == 200 - 64
    assert batch.entered["seq"].tolist() == list(range(204 - 63, 205))
    writer.slots[10]["stamp"] = 12345  # garbage over a slot
    writer.call()
    assert tail.poll().entered["seq"].tolist() == [205]
    writer.close()


def test_restarted_process_gets_its_own_ring_and_the_old_one_ends(tmp_path, ring_writer, dead_pid):
    old = ring_writer(tmp_path / f"rankwatch-n-{dead_pid}.ring", rank=5, pid=dead_pid)
    for _ in range(3):
        old.call()
    rings = RingSet(tmp_path)
    assert [len(r.batch.entered) for r in rings.poll()] == [3]
    new = ring_writer(tmp_path / f"rankwatch-n-{os.getpid()}.ring", rank=5, pid=os.getpid())
    new.call()
    polled = {r.tail.header.pid: r for r in rings.poll()}
    assert polled[dead_pid].ended and not polled[os.getpid()].ended, "superseded by the newer ring of rank 5"
    assert polled[os.getpid()].batch.entered["seq"].tolist() == [1], "the new ring starts its own numbering"
    assert list(rings.tails) == [new.path.name]
    old.call()  # even if the old file changed, it is not followed again
    assert [r.tail.header.pid for r in rings.poll()] == [os.getpid()]
    old.close()
    new.close()


def test_corrupt_and_unfinished_files_are_skipped_and_retried(tmp_path, ring_writer, trace_dir):
    (trace_dir / "rankwatch-garbage-1.ring").write_bytes(b"not a ring" * 1000)
    truncated = trace_dir / "rankwatch-short-2.ring"
    truncated.write_bytes(next(trace_dir.glob("rankwatch-sim-*.ring")).read_bytes()[: HEADER_SIZE + 100])
    rings = RingSet(trace_dir)
    polled = rings.poll()
    assert len(polled) == 4
    assert "not a rankwatch ring" in rings.problems["rankwatch-garbage-1.ring"]
    assert "truncated" in rings.problems["rankwatch-short-2.ring"]
    # a ring whose creator has not written the magic yet becomes readable once it has
    writer = ring_writer(trace_dir / "rankwatch-late-3.ring", rank=3, pid=os.getpid())
    writer.header["magic"] = b"\0" * 8
    rings.poll()
    assert "rankwatch-late-3.ring" in rings.problems
    writer.header["magic"] = b"RWRING\0\0"
    writer.call(op=Op.BROADCAST)
    os.utime(writer.path)  # the tracer's writes move mtime too; make it certain here
    polled = {r.tail.name: r for r in rings.poll()}
    assert polled["rankwatch-late-3.ring"].batch.entered["op"].tolist() == [Op.BROADCAST]
    assert "rankwatch-late-3.ring" not in rings.problems
    writer.close()


def test_a_ring_replaced_under_the_same_name_is_dropped_not_read(tmp_path, ring_writer):
    path = tmp_path / "rankwatch-n-7.ring"
    writer = ring_writer(path, rank=7, pid=os.getpid())
    writer.call()
    rings = RingSet(tmp_path)
    rings.poll()
    writer.close()
    path.write_bytes(b"")  # truncated, as O_TRUNC by a new process with the same pid would
    assert rings.poll() == [] and rings.tails == {}


async def test_records_full_of_garbage_do_not_stop_the_sidecar(trace_dir, make_sidecar, token):
    """Records whose stamps are right but whose fields are random bytes (a writer gone mad)."""
    import aiohttp

    from rankwatch.analysis.ring import HEADER_DTYPE, RECORD_DTYPE

    sidecar = await make_sidecar(trace_dir)
    sidecar.poll()
    path = sorted(trace_dir.glob("*.ring"))[0]
    data = bytearray(path.read_bytes())
    header = np.frombuffer(data, HEADER_DTYPE, count=1)
    claimed, capacity = int(header["next"][0]), int(header["capacity"][0])
    slots = np.frombuffer(data, RECORD_DTYPE, count=capacity, offset=HEADER_SIZE)
    random = np.random.default_rng(7)
    for index in range(claimed, claimed + 50):
        slot = index % capacity
        raw = random.integers(0, 256, RECORD_DTYPE.itemsize, dtype=np.uint8)
        slots[slot : slot + 1] = raw.view(RECORD_DTYPE)
        slots["stamp"][slot] = 2 * index + 2
    slots["op"][claimed % capacity] = Op.ALLREDUCE  # at least one "call" with garbage fields
    header["next"] = claimed + 50
    with open(path, "r+b") as handle:  # in place: the sidecar's map sees it
        handle.write(bytes(data))
    sidecar.poll()
    summary = sidecar.close_window()
    [rank] = [r for r in summary.ranks if r.ring == path.name]
    assert rank.records == claimed + 50, "the first window holds everything read so far"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:
        for path_, headers in (("/metrics", {}), ("/dump", {"Accept": "application/json"}), ("/dump", {})):
            async with session.get(f"http://127.0.0.1:{sidecar.port}{path_}", headers=headers) as response:
                assert response.status == 200, path_
