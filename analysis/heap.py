"""Keep the memory an analysis frees for its next arrays, rather than giving it back to the kernel.

An analysis of 16k ranks makes and drops arrays of hundreds of MB one after another. glibc maps each
array of more than 32 MB on its own and unmaps it when freed, so every new one is faulted in again,
page by page; on a virtual machine that reports free memory to its host (virtio-balloon free page
reporting) those pages come back cold, and the faults were half of the detectors' CPU time at 16k
ranks. Served from the heap and never trimmed, a freed array's pages hold the next one. The
process's peak resident memory stays about what it was (the largest arrays alive at once); it is
not given back until the process exits, so this is for a process that analyses and ends (``rankwatch
analyze``), not a long-lived one.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
NEVER_TRIM = 2**31 - 1  # the largest value mallopt takes (an int): bytes free at the heap's top


def keep_freed_memory() -> bool:
    """Large arrays from the heap, and the heap never trimmed (glibc's ``mallopt``). False where the C
    library has no ``mallopt`` (not glibc) or refuses: nothing changes then."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
