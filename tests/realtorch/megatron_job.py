"""A Megatron-shaped torch.distributed job on CPU (gloo), run under torchrun by the real-PyTorch tests.

Runs inside the cached PyTorch environment (tests/realtorch/torch_env.py), not rankwatch's: it
imports torch only. Ranks are laid out as Megatron lays them out (rank = tp + TP*(dp + DP*pp)) with
one process group per TP, DP and PP group; a step runs the microbatches forward and backward
through the pipeline (send/recv in the PP group, an all-reduce in the TP group after each
stage's compute), then all-reduces the gradients over DP and the loss over the world. Compute is
a sleep by default, so eight ranks on two shared cores keep their pace; ``--compute-kind spin`` spends
it in a Python loop and ``tensor`` in small matrix products, both a fixed amount of work (calibrated
once, the same for every rank), so a busy CPU stretches them as it would a real job's.

Faults: ``--slow-rank R --slow-ms X`` adds X ms to every compute of rank R (``--slow-pct P``: P% of
its compute), from step ``--slow-from-step`` on (a slowdown that starts mid-run); ``--stop-rank R
--stop-step S`` makes rank R stop (sleep outside any collective) before step S: its peers time out
in the collective that waits for it, dump their flight recorders and exit; R writes no dump, unless
``--stop-dumps``: then it dumps after them, as NCCL's dump-on-timeout makes every rank dump (the stuck
rank's watchdog thread is alive while its main thread is not). ``--mismatch-rank R --mismatch-step S
--mismatch op|count|dtype`` makes rank R call, at step S's first TP collective, a broadcast where its TP
peers all-reduce, or the all-reduce with half the elements, or in float64: a code path taken on one
rank only; the TP group hangs there until the timeout. ``--stuck-rank R --stuck-step S``: rank R gets stuck
*inside* a collective: its gloo worker threads of its TP group (its DP group with TP 1) are frozen
(freeze_threads.py), so the all-reduce it calls at step S's first microbatch there is recorded and never
runs; its peers time out and dump, and R dumps from another thread, as NCCL's watchdog would. ``--slow-link
A B --link-ms X``: every transfer between pipeline neighbours A and B arrives X ms late (the receiver
waits that much longer in its receive), as over a degraded link. Gloo aborts a rank that receives more bytes
than it expects (the odd rank's neighbour, with another count or datatype): then torchrun's SIGTERM
is ignored so that the other ranks still time out and dump.

Each surviving rank writes its flight-recorder dump to ``<out>/nccl_trace_rank_<R>`` (pickle from
``_dump_fr_trace``, or JSON from ``_dump_fr_trace_json`` with ``--json``) and ``<out>/journal/rank_<R>.json``
(its groups and sends/receives, which gloo's recorder leaves out); ``--json-out DIR``: the same recorder
again as JSON into DIR (one run in both formats).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--compute-ms", type=float, default=4.0)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-ms", type=float, default=0.0)
    parser.add_argument("--slow-pct", type=float, default=0.0)
    parser.add_argument("--slow-from-step", type=int, default=0)
    parser.add_argument("--compute-kind", choices=("sleep", "spin", "tensor"), default="sleep")
    parser.add_argument("--stop-rank", type=int, default=-1)
    parser.add_argument("--stop-step", type=int, default=-1)
    parser.add_argument("--stop-dumps", action="store_true")
    parser.add_argument("--mismatch-rank", type=int, default=-1)
    parser.add_argument("--mismatch-step", type=int, default=-1)
    parser.add_argument("--mismatch", choices=("op", "count", "dtype"), default="op")
    parser.add_argument("--stuck-rank", type=int, default=-1)
    parser.add_argument("--stuck-step", type=int, default=-1)
    parser.add_argument("--slow-link", type=int, nargs=2, default=(-1, -1))
    parser.add_argument("--link-ms", type=float, default=0.0)
    parser.add_argument("--timeout-s", type=float, default=20.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--json-out", default="", help="also dump as JSON, with the journal, into this directory")
    return parser.parse_args()


class Layout:
    def __init__(self, world: int, tp: int, pp: int) -> None:
        self.world, self.tp, self.pp, self.dp = world, tp, pp, world // (tp * pp)

    def rank(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)


GROUP_KINDS = (("tp", 0, "tensor_parallel"), ("dp", 1, "data_parallel"), ("pp", 2, "pipeline_parallel"))


def make_groups(
    layout: Layout, rank: int, timeout: timedelta, journal: Journal, threads: dict[str, set[int]] | None = None
) -> dict[str, tuple[dist.ProcessGroup, list[int]]]:
    """Every rank creates every group in the same order (new_group's rule); keeps its own. A group of
    kind K holds the ranks that differ only in K's coordinate. ``threads``: filled with the threads each
    of this rank's groups started (its gloo workers)."""
    mine: dict[str, tuple[dist.ProcessGroup, list[int]]] = {}
    sizes = (layout.tp, layout.dp, layout.pp)
    for kind, axis, name in GROUP_KINDS:
        others = [a for a in range(3) if a != axis]
        for outer in range(sizes[others[1]]):
            for inner in range(sizes[others[0]]):
                coords = [0, 0, 0]
                coords[others[0]], coords[others[1]] = inner, outer
                ranks = [layout.rank(*coords[:axis], k, *coords[axis + 1 :]) for k in range(sizes[axis])]
                desc = f"{name}_{inner}_{outer}"
                before = _threads()
                group = dist.new_group(ranks, group_desc=desc, timeout=timeout)
                if rank in ranks:
                    if threads is not None:
                        threads[kind] = _threads() - before
                    mine[kind] = (group, ranks)
                    journal.group(group, desc, ranks)
    return mine


def _threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


class Journal:
    """What the gloo flight recorder leaves out, for tests/realtorch/nccl_style.py: this rank's groups
    (name, desc, ranks) and its sends/receives (time, group, peer), written beside the dump."""

    def __init__(self) -> None:
        self.groups: dict[str, dict[str, object]] = {}
        self.p2p: list[dict[str, object]] = []

    def group(self, group: dist.ProcessGroup, desc: str, ranks: list[int]) -> None:
        self.groups[group.group_name] = {"desc": desc, "ranks": ranks}

    def exchange(self, op: str, group: dist.ProcessGroup, peer: int, ranks: list[int]) -> None:
        self.p2p.append({"op": op, "group": group.group_name, "peer": ranks.index(peer), "t": time.time_ns()})


class Compute:
    """One microbatch's compute: ``compute_ms`` (more on the slow rank once its slowdown began), spent
    as the job asks. Spin and tensor work is counted in units calibrated on this machine and agreed
    by all ranks (the median of their calibrations), so equal ms mean equal work on every rank."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.args, self.rank, self.step = args, rank, 0
        self.units_per_ms = 1.0
        self.a, self.b = torch.rand(48, 48), torch.rand(48, 48)
        if args.compute_kind != "sleep":
            rates = torch.tensor([self._calibrate()])
            gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, rates)
            self.units_per_ms = float(torch.cat(gathered).median())

    def _calibrate(self) -> float:
        started, units = time.perf_counter(), 0
        while time.perf_counter() - started < 0.05:
            self._work(20)
            units += 20
        return units / ((time.perf_counter() - started) * 1e3)

    def _work(self, units: int) -> None:
        if self.args.compute_kind == "spin":
            total = 0
            for i in range(units * 100):
                total += i * i
        else:
            for _ in range(units):
                torch.mm(self.a, self.b)

    def __call__(self) -> None:
        args = self.args
        ms = args.compute_ms
        if self.rank == args.slow_rank and self.step >= args.slow_from_step:
            ms += args.slow_ms + args.compute_ms * args.slow_pct / 100
        if args.compute_kind == "sleep":
            time.sleep(ms / 1e3)
        else:
            self._work(max(1, round(ms * self.units_per_ms)))


def stop(args: argparse.Namespace, rank: int, world: int, journal: Journal, dumps: bool = False) -> None:
    """Stopped outside any collective until the peers have timed out and dumped; then gone, with no
    dump unless ``--stop-dumps``."""
    deadline = time.monotonic() + args.timeout_s * 6
    while time.monotonic() < deadline and len(list(Path(args.out).glob("nccl_trace_rank_*"))) < world - 1:
        time.sleep(0.2)
    if args.stop_dumps or dumps:
        dump(args, rank, journal)
    os._exit(0)


def get_stuck(args: argparse.Namespace, rank: int, world: int, journal: Journal, threads: set[int]) -> None:
    """Freeze this rank's worker threads of the group it is about to call a collective in (not its
    transport loop, which other groups may share), and dump from another thread once the peers have
    timed out and dumped; the caller then enters the collective and never leaves it."""
    ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER_ANY (Yama)
    workers = [t for t in sorted(threads) if _thread_name(t) != "gloo_tcp_loop"]
    freezer = Path(__file__).with_name("freeze_threads.py")
    command = [sys.executable, str(freezer), str(os.getpid()), str(args.timeout_s * 10), *map(str, workers)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    if process.stdout is None or process.stdout.readline().strip() != "frozen":
        raise SystemExit(f"rank {rank}: could not freeze threads {workers}")
    threading.Thread(target=stop, args=(args, rank, world, journal, True), daemon=True).start()


def _thread_name(tid: int) -> str:
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


def late_link(args: argparse.Namespace, rank: int, peer: int) -> None:
    """A receive over the slow link: the data arrives ``--link-ms`` late."""
    if {rank, peer} == set(args.slow_link):
        time.sleep(args.link_ms / 1e3)


def mismatched_call(args: argparse.Namespace, activation: torch.Tensor, group: dist.ProcessGroup) -> None:
    """What the mismatching rank calls where its TP peers all-reduce ``activation``."""
    if args.mismatch == "op":  # receives from a peer that all-reduces: both wait
        dist.broadcast(activation, group_src=0 if dist.get_rank(group) else 1, group=group)
    elif args.mismatch == "count":
        dist.all_reduce(torch.ones(activation.numel() * 2), group=group)
    else:
        dist.all_reduce(activation.double(), group=group)


def dump(args: argparse.Namespace, rank: int, journal: Journal) -> None:
    """The flight recorder into ``--out`` (JSON with ``--json``, else pickle), then as JSON into ``--json-out``
    too when given (the same run in both formats)."""
    recorder = torch._C._distributed_c10d
    if args.json:
        text = recorder._dump_fr_trace_json(includeCollectives=True, onlyActive=False)
        data = text.encode() if isinstance(text, str) else text
    else:
        data = recorder._dump_fr_trace(includeCollectives=True, includeStackTraces=True, onlyActive=False)
    _write_dump(Path(args.out), rank, journal, data)
    if args.json_out:
        text = recorder._dump_fr_trace_json(includeCollectives=True, onlyActive=False)
        _write_dump(Path(args.json_out), rank, journal, text.encode() if isinstance(text, str) else text)


def _write_dump(out: Path, rank: int, journal: Journal, data: bytes) -> None:
    journal_path = out / "journal" / f"rank_{rank}.json"
    journal_path.parent.mkdir(parents=True, exist_ok=True)
    journal_path.write_text(json.dumps({"groups": journal.groups, "p2p": journal.p2p}))
    partial = out / ".partial" / f"nccl_trace_rank_{rank}"
    partial.parent.mkdir(exist_ok=True)
    partial.write_bytes(data)
    partial.rename(out / partial.name)  # whole dumps only: the stopped rank counts them


def train(args: argparse.Namespace, layout: Layout, rank: int, journal: Journal) -> None:
    threads: dict[str, set[int]] = {}
    groups = make_groups(layout, rank, timedelta(seconds=args.timeout_s), journal, threads)
    journal.group(dist.group.WORLD, "default_pg", list(range(layout.world)))
    _, _, stage = layout.coords(rank)
    tp_group = groups["tp"][0]
    pp_group, pp_ranks = groups["pp"]
    dp_group = groups["dp"][0]
    stuck_in = "tp" if layout.tp > 1 else "dp"  # where --stuck-rank gets stuck: its first collective of a step
    activation = torch.ones(256)
    compute = Compute(args, rank)
    for step in range(args.steps):
        compute.step = step
        if rank == args.stop_rank and step == args.stop_step:
            stop(args, rank, layout.world, journal)
        for micro in range(args.microbatches):  # forward
            if stage > 0:
                journal.exchange("recv", pp_group, pp_ranks[stage - 1], pp_ranks)
                dist.recv(activation, src=pp_ranks[stage - 1], group=pp_group)
                late_link(args, rank, pp_ranks[stage - 1])
            compute()
            if rank == args.stuck_rank and step == args.stuck_step and micro == 0 and stuck_in == "tp":
                get_stuck(args, rank, layout.world, journal, threads[stuck_in])
            if rank == args.mismatch_rank and step == args.mismatch_step and micro == 0:
                mismatched_call(args, activation, tp_group)
            else:
                dist.all_reduce(activation, group=tp_group)
            activation /= layout.tp
            if stage < layout.pp - 1:
                journal.exchange("send", pp_group, pp_ranks[stage + 1], pp_ranks)
                dist.send(activation, dst=pp_ranks[stage + 1], group=pp_group)
        for _ in range(args.microbatches):  # backward
            if stage < layout.pp - 1:
                journal.exchange("recv", pp_group, pp_ranks[stage + 1], pp_ranks)
                dist.recv(activation, src=pp_ranks[stage + 1], group=pp_group)
                late_link(args, rank, pp_ranks[stage + 1])
            compute()
            dist.all_reduce(activation, group=tp_group)
            activation /= layout.tp
            if stage > 0:
                journal.exchange("send", pp_group, pp_ranks[stage - 1], pp_ranks)
                dist.send(activation, dst=pp_ranks[stage - 1], group=pp_group)
        if rank == args.stuck_rank and step == args.stuck_step and stuck_in == "dp":
            get_stuck(args, rank, layout.world, journal, threads[stuck_in])
        gradients = torch.ones(1024)
        dist.all_reduce(gradients, group=dp_group)
        loss = torch.ones(1)
        dist.all_reduce(loss)


def main() -> int:
    args = parse()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.mismatch_rank >= 0 and args.mismatch != "op":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    layout = Layout(world, args.tp, args.pp)
    failed = None
    journal = Journal()
    try:
        train(args, layout, rank, journal)
    except RuntimeError as error:  # a peer stopped: the collective timed out
        failed = error
    dump(args, rank, journal)
    if failed is not None:
        print(f"rank {rank}: {failed}".splitlines()[0], file=sys.stderr)
        os._exit(0)  # the process group cannot be torn down cleanly with a peer gone
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
