"""Group calls into collective instances: all members' calls of one (communicator, sequence number).

One sort for the whole trace, not a pass per communicator: a 16k-rank job has thousands of
communicators. Communicator, sequence and row index are packed into one 64-bit key where they fit
(``np.sort`` on integers is several times faster than ``argsort``); within an instance the rows stay
in trace order, i.e. by global rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from rankwatch.analysis.trace import Trace


@dataclass(frozen=True)
class Instances:
    rows: np.ndarray  # row indices into the calls, grouped by instance
    starts: np.ndarray  # where each instance begins in ``rows``; one extra entry at the end
    comm: np.ndarray  # communicator id of each instance
    seq: np.ndarray  # sequence number of each instance
    comm_index: np.ndarray  # index of the instance's communicator in ``comm_ids``
    comm_ids: np.ndarray  # the distinct communicators, sorted

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.starts)

    def __len__(self) -> int:
        return len(self.starts) - 1


def instances_of(trace: Trace, chosen: np.ndarray) -> Instances:
    """:func:`group_instances` of the trace's calls where the mask ``chosen`` is set, kept on the trace
    for the next detector that groups the same calls (mismatches and stragglers group the same
    collectives: each grouping is a sort of millions at 16k ranks; the mask, not the rows, is kept to
    tell them: 1 byte a call). Callers must not write into the result, nor into the mask after."""
    cached = trace._instances
    if cached is not None and cached[0] is trace.calls and np.array_equal(cached[1], chosen):
        return cached[2]
    rows = np.flatnonzero(chosen)
    instances = group_instances(trace.calls["comm"][rows], trace.calls["seq"][rows], rows)
    trace._instances = (trace.calls, chosen, instances)
    return instances


PACK_BLOCK = 1 << 20
"""Keys packed this many at a time (8 MiB of each temporary, not 200 MB of each at 16k ranks)."""


def _bits(value: int) -> int:
    return max(int(value).bit_length(), 1)


def factorize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct values, index of each value among them). The calls come rank by rank and a rank
    uses a few communicators in runs: the distinct values are found among the runs' first values, and
    each value's index by a binary search among those few (no sort of every value)."""
    if not len(values):
        return values[:0].copy(), np.zeros(0, np.int64)
    starts = np.empty(len(values), bool)
    starts[0] = True
    np.not_equal(values[1:], values[:-1], out=starts[1:])
    heads = np.flatnonzero(starts)
    del starts
    firsts = values[heads]
    distinct = np.unique(firsts)
    runs = np.diff(heads, append=len(values))
    return distinct, np.repeat(np.searchsorted(distinct, firsts), runs)  # a search per run, not per value


def group_instances(comm: np.ndarray, seq: np.ndarray, rows: np.ndarray) -> Instances:
    """Instances of the calls ``rows`` (ascending row indices) whose communicator and sequence are given."""
    if not len(rows):
        empty = np.zeros(0, np.int64)
        return Instances(empty, np.zeros(1, np.int64), empty.astype(np.uint64), empty.astype(np.uint64), empty,
                         empty.astype(np.uint64))  # fmt: skip
    comm_ids, comm_index = factorize(comm)
    seq = seq.view(np.int64) if seq.dtype == np.uint64 else seq.astype(np.int64)  # as astype wraps, without a copy
    seq_low = int(seq.min())
    n = len(rows)
    comm_bits, seq_bits, row_bits = _bits(len(comm_ids)), _bits(int(seq.max()) - seq_low), _bits(n)
    if comm_bits + seq_bits + row_bits <= 63:
        packed = np.empty(n, np.int64)
        for low in range(0, n, PACK_BLOCK):  # a block at a time: the temporaries stay small, in cache
            high = min(n, low + PACK_BLOCK)
            block = packed[low:high]
            np.subtract(seq[low:high], seq_low, out=block)
            block <<= row_bits
            block |= np.arange(low, high, dtype=np.int64)
            block |= comm_index[low:high] << (seq_bits + row_bits)
        packed.sort()
        order = packed & ((1 << row_bits) - 1)
        instance_key = packed
        instance_key >>= row_bits
    else:
        order = np.lexsort((np.arange(n), seq, comm_index))
        instance_key = comm_index[order] * (int(seq.max()) - seq_low + 1) + (seq[order] - seq_low)
    boundary = np.flatnonzero(np.r_[True, instance_key[1:] != instance_key[:-1]])
    firsts = order[boundary]
    return Instances(
        rows=rows[order],
        starts=np.r_[boundary, n].astype(np.int64),
        comm=comm_ids[comm_index[firsts]],
        seq=seq[firsts].astype(np.uint64),
        comm_index=comm_index[firsts],
        comm_ids=comm_ids,
    )


def _sorted_groups(
    values: np.ndarray, groups: np.ndarray, count: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``values`` sorted within groups 0..count-1, an all-NaN result, the non-empty groups and each one's
    first and last index into the sorted values. Sorted as one 64-bit key of group and value (integers
    whose range fits), else of group and the value's rank among all: plain sorts of integers, several
    times faster than a sort by two keys (millions of values at 16k ranks)."""
    n, group_bits = len(values), _bits(count)
    scale = _whole_scale(values) if n and values.dtype.kind == "f" else None
    if scale is not None:  # the integer path below, then back: the same floats, sorted the same
        whole, empty, have, lo, hi = _sorted_groups((values * scale).astype(np.int64), groups, count)
        values = whole.astype(np.float64)
        values /= scale
        return values, empty, have, lo, hi
    integers = n and values.dtype.kind in "iu" and int(values.min()) > -(1 << 62) and int(values.max()) < 1 << 62
    low = int(values.min()) if integers else 0
    if integers and _bits(int(values.max()) - low) + group_bits <= 63:
        value_bits = _bits(int(values.max()) - low)
        packed = groups.astype(np.int64) << value_bits
        packed |= values.astype(np.int64) - low
        packed.sort()
        groups = packed >> value_bits
        packed &= (1 << value_bits) - 1
        packed += low
        values = packed.astype(values.dtype)
    elif n and _bits(n) + group_bits <= 63:
        order = np.argsort(values)
        ranked = np.empty(n, np.int64)
        ranked[order] = np.arange(n)
        packed = groups.astype(np.int64) << _bits(n)
        packed |= ranked
        del ranked
        packed.sort()
        groups = packed >> _bits(n)
        packed &= (1 << _bits(n)) - 1
        values = values[order][packed]
    else:
        order = np.lexsort((values, groups))
        groups, values = groups[order], values[order]
    bounds = np.searchsorted(groups, np.arange(count + 1))
    have = np.flatnonzero(np.diff(bounds) > 0)
    return values, np.full(count, np.nan), have, bounds[have], bounds[have + 1] - 1


def _whole_scale(values: np.ndarray) -> int | None:
    """1 or 2 when ``values`` (float64) times it are all whole numbers of less than 2^53, exactly (times
    less clock offsets that are medians of nanoseconds: halves at worst), else None (NaN, -0.0 or
    fractions: sorted as floats)."""
    if values.dtype != np.float64:
        return None
    for scale in (1, 2):
        scaled = values * scale  # exact: a power of two
        if not np.array_equal(np.rint(scaled), scaled):
            continue
        if np.abs(scaled).max() >= 2.0**53:
            return None
        zero = scaled == 0
        return None if np.signbit(scaled[zero]).any() else scale
    return None


class GroupedValues:
    """``values`` sorted within groups 0..count-1 once, for the median and quantiles of the same groups
    (each is a sort of millions at 16k ranks)."""

    def __init__(self, values: np.ndarray, groups: np.ndarray, count: int) -> None:
        self._values, self._empty, self._have, self._lo, self._hi = _sorted_groups(values, groups, count)

    def median(self) -> np.ndarray:
        """Median per group (NaN for an empty group)."""
        out, values, lo, hi = self._empty.copy(), self._values, self._lo, self._hi
        out[self._have] = (values[(lo + hi) // 2] + values[(lo + hi + 1) // 2]) / 2
        return out

    def quantile(self, q: float) -> np.ndarray:
        """The ``q`` quantile (nearest rank, rounded down) per group (NaN for an empty group)."""
        out, lo, hi = self._empty.copy(), self._lo, self._hi
        out[self._have] = self._values[lo + np.floor(q * (hi - lo)).astype(np.int64)]
        return out


def grouped_median(values: np.ndarray, groups: np.ndarray, count: int) -> np.ndarray:
    """Median of ``values`` per group 0..count-1 (NaN for an empty group), with one sort."""
    return GroupedValues(values, groups, count).median()


def grouped_quantile(values: np.ndarray, groups: np.ndarray, count: int, q: float) -> np.ndarray:
    """The ``q`` quantile (nearest rank, rounded down) of ``values`` per group 0..count-1 (NaN for an
    empty group), with one sort."""
    return GroupedValues(values, groups, count).quantile(q)
