"""Keep the memory an analysis frees for its next arrays, rather than giving it back to the kernel.

An analysis of 16k ranks makes and drops arrays of hundreds of MB one after another. glibc maps each
array of more than 32 MB on its own and unmaps it when freed, so every new one is faulted in again,
page by page; on a virtual machine that reports free memory to its host (virtio-balloon free page
reporting) those pages come back cold, and the faults were half of the detectors' CPU time at 16k
ranks. Served from the heap and never trimmed, a freed array's pages hold the next one. The
process's peak resident memory stays about what it was (the largest arrays alive at once); it is
not given back until the process exits, so this is for a process that analyses and ends (``rankwatch
analyze``), not a long-lived one.

Nor are those pages huge ones: numpy advises the kernel to back each large array with 2 MiB pages
(``MADV_HUGEPAGE``), and where the kernel compacts memory for them at once (``defrag`` set to
``madvise``, the default) a machine whose memory the rings just filled with cached file pages
compacts on every fault: at 16k ranks that was a third of the detectors' CPU time.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
NEVER_TRIM = 2**31 - 1  # the largest value mallopt takes (an int): bytes free at the heap's top


def keep_freed_memory() -> bool:
    """Large arrays from the heap, and the heap never trimmed (glibc's ``mallopt``), in pages of the
    ordinary size. False where the C library has no ``mallopt`` (not glibc) or refuses: the heap is
    left as it was then."""
    _no_huge_pages()
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))


def _no_huge_pages() -> None:
    """numpy's huge-page advice off (``NUMPY_MADVISE_HUGEPAGE=0``, set after numpy was imported)."""
    try:
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _set_madvise_hugepage
    _set_madvise_hugepage(False)
