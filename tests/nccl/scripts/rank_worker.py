"""One rank of a traced test scenario: NCCL reached the way PyTorch reaches it.

Run as a subprocess by tests/nccl (RANK, WORLD_SIZE in the environment, the interposer preloaded):
    python rank_worker.py SCENARIO RENDEZVOUS_DIR TORCH_LIKE_SO
libtorch_like.so is loaded with RTLD_LOCAL, so libnccl.so.2 lands in a local scope as under PyTorch.
Prints one JSON line of observations (data results) for the test to check.
"""

import ctypes
import json
import os
import sys
import threading
import time
from pathlib import Path

SCENARIO, RENDEZVOUS, LIBRARY = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
lib = ctypes.CDLL(LIBRARY, mode=os.RTLD_LOCAL)
lib.tl_call.argtypes = [
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_size_t,
]
lib.tl_destroy.argtypes = [ctypes.c_void_p]
lib.tl_split.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
lib.tl_shrink.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
ALLREDUCE, BROADCAST, REDUCE, ALLGATHER, REDUCESCATTER, ALLTOALL, GATHER, SCATTER, SEND, RECV, BCAST = range(1, 12)
FLOAT32, SUM = 7, 0
IdBuffer = ctypes.c_char * 128


def check(result, what):
    if result != 0:
        raise SystemExit(f"rank {RANK}: {what} returned NCCL error {result}")


def unique_id(name, leader):
    path = RENDEZVOUS / f"{name}.id"
    buffer = IdBuffer()
    if leader:
        check(lib.tl_unique_id(buffer), "ncclGetUniqueId")
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_bytes(bytes(buffer))
        temporary.rename(path)
        return buffer
    for _ in range(10000):
        if path.exists():
            return IdBuffer.from_buffer_copy(path.read_bytes())
        time.sleep(0.005)
    raise SystemExit(f"rank {RANK}: no id at {path}")


def init(name, nranks, rank):
    comm = ctypes.c_void_p()
    check(lib.tl_init(ctypes.byref(comm), nranks, unique_id(name, rank == 0), rank), f"init {name}")
    return comm


def floats(values):
    return (ctypes.c_float * len(values))(*values)


def call(op, comm, send, recv, count, root=0, stream=0):
    check(lib.tl_call(op, comm, send, recv, count, FLOAT32, SUM, root, stream), f"op {op}")


def basic():
    world = init("world", WORLD, RANK)
    seen = {}
    buffer = floats([RANK + 1.0] * 4)
    for _ in range(3):
        buffer = floats([RANK + 1.0] * 4)
        call(ALLREDUCE, world, buffer, buffer, 4)
    seen["allreduce"] = list(buffer)
    bcast = floats([RANK * 10.0] * 2)
    call(BROADCAST, world, bcast, bcast, 2, root=1)
    seen["broadcast"] = list(bcast)
    legacy = floats([RANK * 100.0])
    call(BCAST, world, None, legacy, 1, root=2)  # NCCL's ncclBcast calls ncclBroadcast itself
    seen["bcast"] = list(legacy)
    reduced = floats([0.0])
    call(REDUCE, world, floats([1.0]), reduced, 1, root=0)
    seen["reduce"] = list(reduced)
    gathered = floats([0.0] * WORLD)
    call(ALLGATHER, world, floats([float(RANK)]), gathered, 1)
    seen["allgather"] = list(gathered)
    scattered = floats([0.0])
    call(REDUCESCATTER, world, floats([float(i) for i in range(WORLD)]), scattered, 1)
    seen["reducescatter"] = list(scattered)
    swapped = floats([0.0] * WORLD)
    call(ALLTOALL, world, floats([RANK * 10.0 + i for i in range(WORLD)]), swapped, 1)
    seen["alltoall"] = list(swapped)
    call(GATHER, world, floats([float(RANK)]), floats([0.0] * WORLD), 1, root=3)
    call(SCATTER, world, floats([float(i) for i in range(WORLD)]), floats([0.0]), 1, root=3)
    # ring exchange inside one group: deadlocks unless grouped calls are progressed together
    right, left = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    outgoing, incoming = floats([1.0] * 8), floats([0.0] * 8)  # alive until the group ends
    check(lib.tl_group_start(), "group start")
    call(SEND, world, outgoing, None, 8, root=right)
    call(RECV, world, None, incoming, 8, root=left)
    check(lib.tl_group_end(), "group end")
    half = ctypes.c_void_p()
    check(lib.tl_split(world, RANK // 2, RANK, ctypes.byref(half)), "split")
    call(ALLREDUCE, half, floats([1.0]), floats([0.0]), 1)
    if RANK != WORLD - 1:  # the excluded rank does not take part in a shrink
        excluded = (ctypes.c_int * 1)(WORLD - 1)
        small = ctypes.c_void_p()
        check(lib.tl_shrink(world, excluded, 1, ctypes.byref(small)), "shrink")
        call(ALLREDUCE, small, floats([1.0]), floats([0.0]), 1)
        check(lib.tl_destroy(small), "destroy")
    check(lib.tl_destroy(half), "destroy")
    check(lib.tl_destroy(world), "destroy")
    return seen


def threads():
    def work(index):
        comm = init(f"thread-{index}", WORLD, RANK)
        for _ in range(500):
            call(ALLREDUCE, comm, floats([1.0]), floats([0.0]), 1, stream=index + 1)
        check(lib.tl_destroy(comm), "destroy")

    workers = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return {}


def many(count):
    world = init("world", WORLD, RANK)
    before = time.time_ns()
    for _ in range(count):
        call(ALLREDUCE, world, floats([1.0]), floats([0.0]), 1, stream=7)
    return {"before_ns": before, "after_ns": time.time_ns()}


def gpu():
    world = init("world", WORLD, RANK)
    for _ in range(20):
        call(ALLREDUCE, world, floats([1.0]), floats([0.0]), 1, stream=7)
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.rwStandinSetCapturing(ctypes.c_void_p(9), 1)  # stream 9 now captures a CUDA graph
    for _ in range(5):
        call(ALLREDUCE, world, floats([1.0]), floats([0.0]), 1, stream=9)
    time.sleep(0.1)  # the poller completes GPU times within a few milliseconds
    check(lib.tl_destroy(world), "destroy")
    return {}


def init_all():
    """One process, two devices: NCCL's single-process clique, driven from one thread by a group."""
    comms = (ctypes.c_void_p * 2)()
    check(lib.tl_init_all(comms, 2), "ncclCommInitAll")
    results = [floats([0.0]), floats([0.0])]
    inputs = [floats([1.0]), floats([2.0])]  # alive until the group ends: NCCL reads them then
    check(lib.tl_group_start(), "group start")
    for device in range(2):
        call(ALLREDUCE, comms[device], inputs[device], results[device], 1)
    check(lib.tl_group_end(), "group end")
    for device in range(2):
        check(lib.tl_destroy(comms[device]), "destroy")
    return {"sums": [list(r) for r in results]}


def misuse():
    """Misuse gets NCCL's error codes, and the tracer records the failed calls as failed."""
    world = init("world", WORLD, RANK)
    codes = {
        "root_out_of_range": lib.tl_call(BROADCAST, world, floats([1.0]), floats([1.0]), 1, FLOAT32, SUM, 99, 0),
        "send_to_self": lib.tl_call(SEND, world, floats([1.0]), None, 1, FLOAT32, SUM, RANK, 0),
        "bad_datatype": lib.tl_call(ALLREDUCE, world, floats([1.0]), floats([1.0]), 1, 42, SUM, 0, 0),
        "group_end_without_start": lib.tl_group_end(),
    }
    check(lib.tl_destroy(world), "destroy")
    codes["use_after_destroy"] = lib.tl_call(ALLREDUCE, world, floats([1.0]), floats([1.0]), 1, FLOAT32, SUM, 0, 0)
    return codes


scenarios = {
    "init_all": init_all,
    "misuse": misuse,
    "basic": basic,
    "threads": threads,
    "many": lambda: many(300),
    "gpu": gpu,
    "few": lambda: many(5),
}
print(json.dumps(scenarios[SCENARIO]()), flush=True)
