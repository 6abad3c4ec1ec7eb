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
lib.tl_abort.argtypes = [ctypes.c_void_p]
lib.tl_compute.argtypes = [ctypes.c_size_t, ctypes.c_int64]
lib.tl_work_allreduce.argtypes = [
    ctypes.c_size_t,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
]
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


KEEP_ALIVE = []  # on an asynchronous device NCCL reads and writes buffers after the call returned


def floats(values):
    buffer = (ctypes.c_float * len(values))(*values)
    KEEP_ALIVE.append(buffer)
    return buffer


def settle():
    """What reading a tensor on the host implies: wait for the device (a no-op when it is synchronous)."""
    check(ctypes.CDLL("libcuda.so.1").cuCtxSynchronize(), "cuCtxSynchronize")


def call(op, comm, send, recv, count, root=0, stream=0):
    check(lib.tl_call(op, comm, send, recv, count, FLOAT32, SUM, root, stream), f"op {op}")


def basic():
    world = init("world", WORLD, RANK)
    seen = {}
    buffer = floats([RANK + 1.0] * 4)
    for _ in range(3):
        buffer = floats([RANK + 1.0] * 4)
        call(ALLREDUCE, world, buffer, buffer, 4)
    settle()
    seen["allreduce"] = list(buffer)
    bcast = floats([RANK * 10.0] * 2)
    call(BROADCAST, world, bcast, bcast, 2, root=1)
    settle()
    seen["broadcast"] = list(bcast)
    legacy = floats([RANK * 100.0])
    call(BCAST, world, None, legacy, 1, root=2)  # NCCL's ncclBcast calls ncclBroadcast itself
    settle()
    seen["bcast"] = list(legacy)
    reduced = floats([0.0])
    call(REDUCE, world, floats([1.0]), reduced, 1, root=0)
    settle()
    seen["reduce"] = list(reduced)
    gathered = floats([0.0] * WORLD)
    call(ALLGATHER, world, floats([float(RANK)]), gathered, 1)
    settle()
    seen["allgather"] = list(gathered)
    scattered = floats([0.0])
    call(REDUCESCATTER, world, floats([float(i) for i in range(WORLD)]), scattered, 1)
    settle()
    seen["reducescatter"] = list(scattered)
    swapped = floats([0.0] * WORLD)
    call(ALLTOALL, world, floats([RANK * 10.0 + i for i in range(WORLD)]), swapped, 1)
    settle()
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
    settle()
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


# ---- the stand-in device (run with RANKWATCH_STANDIN_DEVICE=async) ------------------------------------
NOT_READY = 600


def device():
    """The stand-in libcuda.so.1: the same library the stand-in NCCL launches its operations on."""
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.rwStandinLaunchKernel.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    for name in ("cuEventRecord", "cuStreamWaitEvent"):
        getattr(cuda, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p] + ([ctypes.c_uint] if "Wait" in name else [])
    for name in ("cuEventQuery", "cuEventSynchronize", "cuStreamSynchronize", "cuStreamQuery"):
        getattr(cuda, name).argtypes = [ctypes.c_void_p]
    cuda.cuEventElapsedTime.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
    return cuda


def new_stream(cuda):
    stream = ctypes.c_void_p()
    check(cuda.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")
    return stream


def new_event(cuda):
    event = ctypes.c_void_p()
    check(cuda.cuEventCreate(ctypes.byref(event), 0), "cuEventCreate")
    return event


def elapsed_ms(cuda, start, end):
    value = ctypes.c_float()
    check(cuda.cuEventElapsedTime(ctypes.byref(value), start, end), "cuEventElapsedTime")
    return value.value


def micros_since(t0):
    return (time.perf_counter_ns() - t0) / 1e3


def run_ahead():
    """Rank 1 arrives 300 ms late: rank 0's call returns at once, its stream completes when rank 1 arrived."""
    cuda = device()
    world = init("world", WORLD, RANK)
    stream, done = new_stream(cuda), new_event(cuda)
    if RANK == 1:
        time.sleep(0.3)
    send, recv = floats([RANK + 1.0] * 4), floats([0.0] * 4)
    called_ns = time.time_ns()
    call(ALLREDUCE, world, send, recv, 4, stream=stream.value)
    returned_ns = time.time_ns()
    check(cuda.cuEventRecord(done, stream), "cuEventRecord")
    query_after_call = cuda.cuEventQuery(done)
    check(cuda.cuStreamSynchronize(stream), "cuStreamSynchronize")
    seen = {"called_ns": called_ns, "returned_ns": returned_ns, "synced_ns": time.time_ns(),
            "query_after_call": query_after_call, "result": list(recv)}  # fmt: skip
    seen["query_after_sync"] = cuda.cuEventQuery(done)
    check(lib.tl_destroy(world), "destroy")
    return seen


def kernels():
    """Event timing of kernels, and a host that launches a second of work in a few milliseconds."""
    cuda = device()
    stream, start, end = new_stream(cuda), new_event(cuda), new_event(cuda)
    check(cuda.cuEventRecord(start, stream), "record")
    check(cuda.rwStandinLaunchKernel(stream, 100_000_000), "kernel")
    check(cuda.cuEventRecord(end, stream), "record")
    query_while_running = cuda.cuEventQuery(end)
    t0 = time.perf_counter_ns()
    for _ in range(int(os.environ.get("KERNELS", "20"))):
        check(cuda.rwStandinLaunchKernel(stream, int(os.environ.get("KERNEL_NS", "30000000"))), "kernel")
    launch_ms = micros_since(t0) / 1e3
    launched = new_event(cuda)
    check(cuda.cuEventRecord(launched, stream), "record")
    query_after_launches = cuda.cuEventQuery(launched)
    check(cuda.cuEventSynchronize(end), "cuEventSynchronize")
    event_ms = elapsed_ms(cuda, start, end)
    t1 = time.perf_counter_ns()
    check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
    return {
        "query_while_running": query_while_running,
        "query_after_launches": query_after_launches,
        "launch_ms": launch_ms,
        "event_ms": event_ms,
        "ctx_sync_ms": micros_since(t1) / 1e3,
        "stream_query_after": cuda.cuStreamQuery(stream),
    }


def hung_peer():
    """Rank 1 never calls: rank 0's call returns, and its host blocks in cuStreamSynchronize."""
    cuda = device()
    world = init("world", WORLD, RANK)
    if RANK == 1:
        time.sleep(2.5)
        return {}
    stream = new_stream(cuda)
    t0 = time.perf_counter_ns()
    call(ALLREDUCE, world, floats([1.0]), floats([0.0]), 1, stream=stream.value)
    call_us = micros_since(t0)
    synced = threading.Event()
    threading.Thread(target=lambda: (cuda.cuStreamSynchronize(stream), synced.set()), daemon=True).start()
    blocked = not synced.wait(timeout=1.5)
    print(json.dumps({"call_us": call_us, "sync_blocked_1_5_s": blocked}), flush=True)
    os._exit(0)  # the stream never drains: leave without destroying the communicator


def abort():
    """Rank 1 never calls; rank 0 aborts the communicator (PyTorch's watchdog does) and its stream drains."""
    cuda = device()
    world = init("world", WORLD, RANK)
    if RANK == 1:
        time.sleep(2.0)
        return {}
    stream = new_stream(cuda)
    call(ALLREDUCE, world, floats([1.0]), floats([0.0]), 1, stream=stream.value)
    time.sleep(0.3)
    pending = cuda.cuStreamQuery(stream)
    t0 = time.perf_counter_ns()
    result = lib.tl_abort(world)
    check(cuda.cuStreamSynchronize(stream), "cuStreamSynchronize")
    return {"pending_before_abort": pending, "abort_result": result, "drained_ms": micros_since(t0) / 1e3}


def ordered():
    """PyTorch's ordering: a compute kernel, then an allreduce on its own stream that waits for it.
    Rank 1's kernel is longer (a straggler): its peer's collective starts earlier and waits for it."""
    cuda = device()
    world = init("world", WORLD, RANK)
    compute, side = new_stream(cuda), new_stream(cuda)
    warm_up = floats([0.0])  # the tracer sets up its GPU timing at the first collective
    check(lib.tl_work_allreduce(compute.value, side.value, world, warm_up, warm_up, 1), "tl_work_allreduce")
    check(cuda.cuStreamSynchronize(compute), "cuStreamSynchronize")
    send, recv = floats([RANK + 1.0] * 4), floats([0.0] * 4)
    kernel_ms = 200 if RANK == 0 else 400
    launched_ns = time.time_ns()
    check(lib.tl_compute(compute.value, kernel_ms * 1000), "tl_compute")
    t0 = time.perf_counter_ns()
    check(lib.tl_work_allreduce(compute.value, side.value, world, send, recv, 4), "tl_work_allreduce")
    call_us = micros_since(t0)
    check(cuda.cuStreamSynchronize(compute), "cuStreamSynchronize")  # loss.item(): after the allreduce
    result = list(recv)
    time.sleep(0.05)  # the tracer's poller completes GPU times within a few milliseconds
    check(lib.tl_destroy(world), "destroy")
    return {"launched_ns": launched_ns, "kernel_ms": kernel_ms, "call_us": call_us, "result": result}


scenarios = {
    "run_ahead": run_ahead,
    "kernels": kernels,
    "hung_peer": hung_peer,
    "abort": abort,
    "ordered": ordered,
    "init_all": init_all,
    "misuse": misuse,
    "basic": basic,
    "threads": threads,
    "many": lambda: many(300),
    "gpu": gpu,
    "few": lambda: many(5),
}
print(json.dumps(scenarios[SCENARIO]()), flush=True)
