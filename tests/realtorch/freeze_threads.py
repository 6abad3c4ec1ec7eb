"""Freeze some threads of a process (ptrace: seized and interrupted, never resumed) until it exits.

Run by megatron_job.py's ``--stuck-rank``: the rank's gloo worker threads of one process group stop, so
a collective it then calls is recorded and never runs, as when a rank is stuck inside a collective (a
hung kernel, a dead link) while its other threads (the flight recorder's dump) still work. The frozen
threads' exits are reaped here (a traced thread that is never waited for keeps its process a zombie);
after ``deadline_s`` the threads are let go, should the process outlive the run.

    python freeze_threads.py PID DEADLINE_S TID [TID ...]
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

PTRACE_SEIZE, PTRACE_INTERRUPT = 0x4206, 0x4207
WALL = 0x40000000  # __WALL: wait for threads too


def main() -> int:
    pid, deadline_s, tids = int(sys.argv[1]), float(sys.argv[2]), [int(t) for t in sys.argv[3:]]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    for tid in tids:
        if libc.ptrace(PTRACE_SEIZE, tid, None, None) or libc.ptrace(PTRACE_INTERRUPT, tid, None, None):
            print(f"freeze_threads: thread {tid} of {pid}: errno {ctypes.get_errno()}", file=sys.stderr)
            return 1
    print("frozen", flush=True)
    deadline = time.monotonic() + deadline_s
    alive = set(tids)
    while alive and time.monotonic() < deadline:
        try:
            tid, status = os.waitpid(-1, os.WNOHANG | WALL)
        except ChildProcessError:
            break
        if tid == 0:
            time.sleep(0.1)
        elif os.WIFEXITED(status) or os.WIFSIGNALED(status):
            alive.discard(tid)
    return 0  # exiting detaches whatever is still traced: those threads run again


if __name__ == "__main__":
    raise SystemExit(main())
