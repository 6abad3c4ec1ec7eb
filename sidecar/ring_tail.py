"""Follow the ring files of a pod's ranks: each poll returns only what changed since the last one.

A record is first seen when its writer publishes it (usually ENTERED) and finishes later, when the
call returns (or, when GPU-timed, when its GPU work ends). A tail therefore reads the new claims and
re-reads the few claims still unfinished, both with one vectorised gather from the read-only map.
A slot whose stamp is odd is being written: it is retried once, then counted as torn. Claims the
ring wrapped over before they were read are counted as overwritten. Nothing here is fatal.

A restarted process writes a new ring (new pid): the old ring is finished (read one last time,
then closed) once its process is gone or a newer ring of the same rank appears, so the two are
never mixed.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rankwatch.analysis.ring import (
    HEADER_DTYPE,
    RECORD_DTYPE,
    RingError,
    RingHeader,
    RingReader,
    State,
    gpu_in_flight,
    take,
)

log = logging.getLogger(__name__)

RING_GLOB_SUFFIX = ".ring"
_TICKS = os.sysconf("SC_CLK_TCK")
_EMPTY = np.empty(0, RECORD_DTYPE)
_SHARE_HINT = (
    "set shareProcessNamespace: true on the pod; until then rings end only when a newer ring of the same rank "
    "replaces them, and a 'silent' stall cannot tell a finished process from a hung one"
)
_NO_CLAIMS = np.empty(0, np.uint64)


def finished(records: np.ndarray, claims: np.ndarray | None = None) -> np.ndarray:
    """Mask of records whose call is over: returned (and GPU work ended, when GPU-timed) or failed.
    ``claims``: the records' claim indices (default: array order), for the order of their streams."""
    state = records["state"]
    returned = (state == State.RETURNED) & ~gpu_in_flight(records, claims)
    return (state == State.FAILED) | (state == State.GPU_DONE) | returned


@dataclass(frozen=True)
class TailBatch:
    """What one poll of one ring found."""

    entered: np.ndarray  # records seen for the first time, claim order
    finished: np.ndarray  # records whose call finished since the last poll (first-seen ones included)
    torn: int
    overwritten: int


class ProcessProbe:
    """Is the process that writes a ring alive? Reads /proc; needs the pod's PID namespace shared.

    A pid alone may have been reused, so the process must also have started before the ring was
    created. When a ring keeps growing while /proc shows no such process, the writers are in
    another PID namespace: from then on every process counts as alive (rings then end only when a
    newer ring of the same rank replaces them) and one warning says how to fix it.
    """

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self.proc = proc
        # PID 1 of its own namespace: a pod sharing its PID namespace has the pause process as PID 1.
        self.visible = os.getpid() != 1
        if not self.visible:
            log.warning("the sidecar is PID 1: it does not see the trainer's processes (%s)", _SHARE_HINT)

    def alive(self, header: RingHeader) -> bool:
        if not self.visible:
            return True
        try:
            stat = (self.proc / str(header.pid) / "stat").read_bytes()
        except OSError:
            return False
        # the command name (field 2) may hold spaces: fields are counted after its closing ')'
        after_name = stat[stat.rfind(b")") + 2 :].split()
        started_ns = int(after_name[19]) * 1_000_000_000 // _TICKS
        suspended_ns = time.clock_gettime_ns(time.CLOCK_BOOTTIME) - time.monotonic_ns()
        return started_ns <= header.start_monotonic_ns + suspended_ns + 1_000_000_000

    def saw_growth_without_process(self, path: Path) -> None:
        if self.visible:
            self.visible = False
            log.warning("%s grows but its process is not in %s (%s)", path, self.proc, _SHARE_HINT)


def ring_identity(path: Path) -> tuple[int, int] | None:
    """(pid, start time) from a ring file's header without mapping it, or None when unreadable."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(HEADER_DTYPE.itemsize)
    except OSError:
        return None
    if len(raw) < HEADER_DTYPE.itemsize:
        return None
    header = np.frombuffer(raw, HEADER_DTYPE, count=1)[0]
    return int(header["pid"]), int(header["start_realtime_ns"])


class RingTail:
    """One ring file, read incrementally from its oldest record still present."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = RingReader(path)
        self.header = self.reader.header()
        self.identity = (self.header.pid, self.header.start_realtime_ns)
        stat = os.stat(path)
        self._inode, self._size = stat.st_ino, stat.st_size
        self.capacity = self.reader.capacity
        self.cursor = max(0, self.header.claimed - self.capacity)
        self.pending = _EMPTY  # latest copies of records seen but unfinished (in flight), claim order
        self._pending_claims = _NO_CLAIMS
        self._retry = _NO_CLAIMS  # claims being written at the last poll
        self.last_activity_ns = self.header.start_realtime_ns  # latest call or return seen
        self.last_call_ns: int | None = None
        self._claimed_before = self.header.claimed
        self.grew = False  # the writer claimed records since the previous poll
        self.claimed_when_gone: int | None = None  # records claimed when /proc first showed no writer
        self.polls = 0
        self.records_read = 0
        self.torn = 0
        self.overwritten = 0

    @property
    def name(self) -> str:
        return self.path.name

    def lag(self) -> int:
        """Records the writer claimed that this tail has not read yet."""
        return max(0, self.reader.claimed - self.cursor)

    def replaced(self) -> bool:
        """True when the file is no longer this ring (deleted, truncated, re-created under the same name):
        reading the old map could then fault. Refreshes ``header`` otherwise."""
        try:
            stat = os.stat(self.path)
        except OSError:
            return True
        if (stat.st_ino, stat.st_size) != (self._inode, self._size):
            return True
        self.header = self.reader.header()
        return (self.header.pid, self.header.start_realtime_ns) != self.identity

    def poll(self) -> TailBatch:
        claimed = self.reader.claimed
        self.grew = claimed > self._claimed_before
        self._claimed_before = claimed
        self.polls += 1
        oldest = max(0, claimed - self.capacity)
        fresh = np.arange(max(self.cursor, oldest), claimed, dtype=np.uint64)
        overwritten = max(0, oldest - self.cursor)
        # claims still wanted but wrapped over meanwhile are lost (counted, not read)
        retry = self._retry[self._retry >= oldest]
        pending = self._pending_claims[self._pending_claims >= oldest]
        overwritten += len(self._retry) - len(retry) + len(self._pending_claims) - len(pending)
        self.cursor = max(self.cursor, claimed)
        if not (len(fresh) or len(retry) or len(pending)):
            return TailBatch(_EMPTY, _EMPTY, 0, overwritten)

        claims = np.concatenate((retry, pending, fresh))
        records, valid = self.reader.records_at(claims)
        first_seen = np.ones(len(claims), bool)
        first_seen[len(retry) : len(retry) + len(pending)] = False
        writing = ~valid & (records["stamp"] == claims * np.uint64(2) + np.uint64(1))
        retry_now = writing & first_seen
        retry_now[: len(retry)] = False  # written-to for a whole poll: the writer died inside it
        torn = int((~valid & ~retry_now).sum())

        if valid.all():
            done = finished(records, claims)
        else:  # a torn slot holds another call's fields: it must not order this ring's streams
            done = np.zeros(len(records), bool)
            done[valid] = finished(take(records, valid), claims[valid])
        seen_before = len(retry) + len(pending)
        if not len(retry) and valid[seen_before:].all():
            entered = records[seen_before:]  # the usual case: a view, no copy
        else:
            entered = take(records, valid & first_seen)
        unfinished = valid & ~done
        self.pending = take(records, unfinished)
        self._pending_claims = claims[unfinished]
        self._retry = claims[retry_now]
        finished_now = records if done.all() else take(records, done)

        if len(entered):
            self.last_call_ns = max(self.last_call_ns or 0, int(entered["t_call_ns"].max()))
            self.last_activity_ns = max(self.last_activity_ns, self.last_call_ns)
        if len(finished_now):
            self.last_activity_ns = max(self.last_activity_ns, int(finished_now["t_return_ns"].max()))
        self.records_read += len(entered)
        self.torn += torn
        self.overwritten += overwritten
        return TailBatch(entered, finished_now, torn, overwritten)

    def end(self) -> np.ndarray:
        """The ring is over: calls that returned on the host but whose GPU end was never recorded
        (the process exited first) count as finished; the rest stay unfinished."""
        returned = self.pending["state"] >= State.RETURNED
        done = take(self.pending, returned)
        self.pending = take(self.pending, ~returned)
        return done

    def close(self) -> None:
        self.reader.close()


@dataclass(frozen=True)
class PolledRing:
    tail: RingTail
    batch: TailBatch
    alive: bool
    ended: bool  # this was the ring's last poll


class RingSet:
    """The rings of one trace directory: discovered, tailed, and finished when their process is gone."""

    def __init__(self, directory: Path, probe: ProcessProbe | None = None) -> None:
        self.directory = directory
        self.probe = probe or ProcessProbe()
        self.tails: dict[str, RingTail] = {}
        self.problems: dict[str, str] = {}  # file name -> why it cannot be read
        self._ended: dict[str, tuple[int, int] | None] = {}  # file name -> identity of the ring that ended
        self._problem_stats: dict[str, tuple[int, int]] = {}

    def _discover(self) -> None:
        try:
            entries = [e for e in os.scandir(self.directory) if e.name.endswith(RING_GLOB_SUFFIX) and e.is_file()]
        except FileNotFoundError:
            return
        for entry in entries:
            name = entry.name
            if name in self.tails:
                continue
            if name in self._ended:
                if ring_identity(Path(entry.path)) == self._ended[name]:
                    continue
                del self._ended[name]  # the same name holds a new ring (pid reused after a restart)
            stat = entry.stat()
            if self._problem_stats.get(name) == (stat.st_size, stat.st_mtime_ns):
                continue  # unchanged since it was found unreadable
            try:
                self.tails[name] = RingTail(Path(entry.path))
            except (RingError, OSError) as error:
                # a ring being created is complete once its magic is written: retried when the file changes
                if name not in self.problems:
                    log.info("skipping %s (retried when the file changes)", error)
                self.problems[name] = str(error)
                self._problem_stats[name] = (stat.st_size, stat.st_mtime_ns)
                continue
            self.problems.pop(name, None)
            self._problem_stats.pop(name, None)

    def _superseded(self, tail: RingTail) -> bool:
        header = tail.header
        if header.global_rank < 0:
            return False
        return any(
            other is not tail
            and other.header.global_rank == header.global_rank
            and other.header.hostname == header.hostname
            and other.header.start_realtime_ns > header.start_realtime_ns
            for other in self.tails.values()
        )

    def poll(self) -> list[PolledRing]:
        """Read every ring once; rings that ended are closed after this poll (their last batch included)."""
        self._discover()
        polled = []
        for name, tail in list(self.tails.items()):
            if tail.replaced():
                log.warning("%s was replaced under the sidecar; its unread records are lost", tail.path)
                tail.close()
                del self.tails[name]
                continue
            try:
                batch = tail.poll()
            except RingError as error:  # pragma: no cover - the reader raises only at open
                self.problems[name] = str(error)
                tail.close()
                del self.tails[name]
                continue
            alive = self.probe.alive(tail.header)
            if not alive:
                # growth after a poll that found the process gone proves the writers are out of sight
                if tail.claimed_when_gone is not None and tail.header.claimed > tail.claimed_when_gone:
                    self.probe.saw_growth_without_process(tail.path)
                    alive = True
                else:
                    tail.claimed_when_gone = tail.reader.claimed  # read after /proc said gone
            # a dead writer's ring ends at its second poll: the first read everything it holds
            ended = self._superseded(tail) or (not alive and not tail.grew and tail.polls > 1)
            if ended and len(returned := tail.end()):
                batch = TailBatch(
                    batch.entered, np.concatenate([batch.finished, returned]), batch.torn, batch.overwritten
                )
            polled.append(PolledRing(tail, batch, alive, ended))
        for ring in polled:
            if ring.ended:
                self._ended[ring.tail.name] = ring.tail.identity
                del self.tails[ring.tail.name]
                ring.tail.close()
        return polled

    def close(self) -> None:
        for tail in self.tails.values():
            tail.close()
        self.tails.clear()
