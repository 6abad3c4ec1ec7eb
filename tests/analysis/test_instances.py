"""Grouping calls into collective instances, and the analysing process's memory."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np

from rankwatch.analysis import instances
from rankwatch.analysis.instances import group_instances


def test_instances_packed_block_by_block_are_grouped_as_by_a_three_key_sort(monkeypatch):
    rng = np.random.default_rng(3)
    n = 50_000
    comm = rng.choice(np.array([7, 2**40 + 3, 2**63 + 11], np.uint64), n)
    seq = rng.integers(0, 5_000, n).astype(np.uint64)
    rows = np.sort(rng.choice(4 * n, n, replace=False))
    monkeypatch.setattr(instances, "PACK_BLOCK", 4_096)  # many blocks, and a short last one
    grouped = group_instances(comm, seq, rows)
    order = np.lexsort((np.arange(n), seq, comm))
    assert np.array_equal(grouped.rows, rows[order])
    key = np.stack([comm[order], seq[order]], axis=1)
    boundary = np.flatnonzero(np.r_[True, (key[1:] != key[:-1]).any(axis=1)])
    assert np.array_equal(grouped.starts, np.r_[boundary, n])
    assert np.array_equal(grouped.comm, comm[order][boundary])
    assert np.array_equal(grouped.seq, seq[order][boundary])
    assert np.array_equal(grouped.comm_ids[grouped.comm_index], grouped.comm)


def test_an_analysing_process_keeps_freed_arrays_in_its_heap():
    """``rankwatch analyze`` serves large arrays from the heap: a freed one's pages hold the next."""
    script = textwrap.dedent(
        """
        import numpy as np
        from rankwatch.analysis.heap import keep_freed_memory

        def in_heap(array):
            address = array.__array_interface__["data"][0]
            for line in open("/proc/self/maps"):
                span, *rest = line.split()
                low, high = (int(part, 16) for part in span.split("-"))
                if low <= address < high:
                    return rest[-1] == "[heap]"

        print(in_heap(np.ones(64 << 20, np.uint8)), keep_freed_memory(), in_heap(np.ones(64 << 20, np.uint8)))
        """
    )
    answer = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert answer == ["False", "True", "True"]


def test_an_analysing_process_asks_for_no_huge_pages():
    """Huge pages compact memory on every fault once the rings fill it with cached file pages: the
    analysing process's large arrays are not advised into them."""
    script = textwrap.dedent(
        """
        import numpy as np
        from rankwatch.analysis.heap import keep_freed_memory

        def advised_huge(array):
            address = array.__array_interface__["data"][0] + array.nbytes // 2  # numpy advises from a page on
            for line in open("/proc/self/smaps"):
                if "-" in line.split()[0] and ":" not in line.split()[0]:
                    low, high = (int(part, 16) for part in line.split()[0].split("-"))
                    inside = low <= address < high
                elif inside and line.startswith("VmFlags:"):
                    return "hg" in line.split()[1:]

        keep_freed_memory()
        print(advised_huge(np.ones(64 << 20, np.uint8)))
        """
    )
    answer = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert answer == ["False"]


def test_medians_and_quantiles_of_halves_and_odd_floats_are_those_of_a_plain_sort():
    """Floats that are whole halves are sorted as integers: the same values come out, -0.0 and NaN too."""
    rng = np.random.default_rng(8)
    groups = rng.integers(0, 40, 20_000)
    for values in (rng.integers(-10**9, 10**9, 20_000) / 2, rng.normal(size=20_000), np.r_[-0.0, 0.0, np.zeros(19_998)],
                   np.r_[np.nan, rng.integers(0, 9, 19_999) / 2]):  # fmt: skip
        grouped = instances.GroupedValues(values, groups, 41)
        for q in (0.1, 0.25, 0.5, 0.9):
            expected = np.full(41, np.nan)
            for group in range(40):
                own = np.sort(values[groups == group])
                expected[group] = own[int(np.floor(q * (len(own) - 1)))]
            assert np.array_equal(grouped.quantile(q), expected, equal_nan=True)
        sorted_groups = [np.sort(values[groups == group]) for group in range(40)]  # NaN last, as a sort puts it
        medians = np.array([(own[(len(own) - 1) // 2] + own[len(own) // 2]) / 2 for own in sorted_groups] + [np.nan])
        assert np.array_equal(grouped.median(), medians, equal_nan=True)
        assert np.array_equal(np.signbit(grouped.median()), np.signbit(medians))
