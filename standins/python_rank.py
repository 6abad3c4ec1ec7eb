"""One rank of a training loop written in Python, on the stand-in NCCL: a trainer with a Python stack.

NCCL is reached as PyTorch reaches it: ``libtorch_like.so`` (linked against libnccl.so.2) loaded
through ctypes with RTLD_LOCAL, so the preloaded interposer traces every call. Each step computes
(``forward`` a third of ``--compute-us``, ``backward`` two thirds; sleeps), loads the next batch, and
all-reduces the gradients over the world communicator. With ``RANKWATCH_STANDIN_DATA_STALL_AT_STEP=N``
the batch of step N never arrives (a data loader stuck on storage): the rank stops in ``load_batch``
while its peers wait in ``all_reduce``. With ``RANKWATCH_STANDIN_BACKWARD_SLOWDOWN=0.6`` its
``backward`` takes 60% longer (a slower kernel in one layer): a straggler in one function.

    RANK=r WORLD_SIZE=w RANKWATCH_STANDIN_RENDEZVOUS=DIR python -m rankwatch.standins.python_rank
        [--steps S] [--compute-us U]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from pathlib import Path

from rankwatch.standins.native import native_artifacts

DATA_STALL_AT_STEP = "RANKWATCH_STANDIN_DATA_STALL_AT_STEP"
BACKWARD_SLOWDOWN = "RANKWATCH_STANDIN_BACKWARD_SLOWDOWN"
ALLREDUCE, FLOAT32, SUM = 1, 7, 0
ID_BYTES = 128


class Nccl:
    """The few NCCL calls a data-parallel loop makes, through libtorch_like.so."""

    def __init__(self, rank: int, world: int, rendezvous: Path) -> None:
        self.lib = ctypes.CDLL(str(native_artifacts().torch_like), mode=os.RTLD_LOCAL)
        self.lib.tl_call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                     ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_size_t]  # fmt: skip
        self.rank = rank
        self.comm = ctypes.c_void_p()
        unique = self._unique_id(rendezvous / "python-world.id", rank == 0)
        self._check(self.lib.tl_init(ctypes.byref(self.comm), world, unique, rank), "ncclCommInitRank")

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            raise SystemExit(f"rank {self.rank}: {what} returned NCCL error {result}")

    def _unique_id(self, path: Path, leader: bool) -> ctypes.Array:
        buffer = (ctypes.c_char * ID_BYTES)()
        if leader:
            self._check(self.lib.tl_unique_id(buffer), "ncclGetUniqueId")
            temporary = path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_bytes(bytes(buffer))
            temporary.rename(path)
            return buffer
        for _ in range(12_000):
            if path.exists():
                return (ctypes.c_char * ID_BYTES).from_buffer_copy(path.read_bytes())
            time.sleep(0.005)
        raise SystemExit(f"rank {self.rank}: no NCCL id at {path} after 60 s")

    def all_reduce(self, values: ctypes.Array) -> None:
        self._check(self.lib.tl_call(ALLREDUCE, self.comm, values, values, len(values), FLOAT32, SUM, 0, 0),
                    "ncclAllReduce")  # fmt: skip


def load_batch(step: int, stall_at: int | None) -> list[float]:
    """The next batch; at ``stall_at`` the storage behind it never answers."""
    if step == stall_at:
        while True:
            time.sleep(3600)
    return [float(step)] * 16


def forward(compute_us: int) -> None:
    time.sleep(compute_us / 3e6)


def backward(compute_us: int, slowdown: float) -> None:
    time.sleep(2 * compute_us * (1 + slowdown) / 3e6)


def train(steps: int, compute_us: int) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rendezvous = Path(os.environ.get("RANKWATCH_STANDIN_RENDEZVOUS") or "/tmp/rankwatch-standin/python")
    stall = os.environ.get(DATA_STALL_AT_STEP)
    slowdown = float(os.environ.get(BACKWARD_SLOWDOWN) or 0)
    nccl = Nccl(rank, world, rendezvous)
    gradients = (ctypes.c_float * 1024)()
    for step in range(1, steps + 1):
        batch = load_batch(step, int(stall) if stall else None)
        forward(compute_us)
        backward(compute_us, slowdown)
        gradients[0] = batch[0]
        nccl.all_reduce(gradients)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compute-us", type=int, default=2000)
    args = parser.parse_args()
    train(args.steps, args.compute_us)


if __name__ == "__main__":
    main()
