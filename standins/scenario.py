"""Synthetic Megatron-shaped traces with ground truth, fast enough for 16,384 ranks.

`rankwatch simulate` runs real processes and is the realistic source for small worlds; this model
is for large worlds, many seeds and exact ground truth. It runs every rank in lock step, vectorised
over ranks: each phase every rank computes (its own speed, jitter) and then calls one collective (or
one grouped Send/Recv with its pipeline neighbours); a collective returns for all members a transfer
time after the last member arrived. A step is, per microbatch, a forward and a backward of
``tp_calls`` TP AllReduces each followed by the pipeline exchange, then a DP AllReduce and a world
AllReduce (the loss). Faults: slower ranks (from a step on), a slow link between two pipeline
neighbours, a rank that stops before its n-th call (everyone who needs it then waits forever), a
rank whose n-th call never completes (its GPU work never starts). Clocks can be skewed per node.
Calls are kept as ``[rank, call]`` matrices, so the trace comes out sorted by rank and time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rankwatch.analysis.ring import Op
from rankwatch.analysis.topology import Layout
from rankwatch.analysis.trace import CALL_DTYPE, Communicator, RankSource, Trace

START_NS = 1_790_000_000 * 10**9
LAUNCH_NS = 5_000  # host call to GPU kernel start
HOST_CALL_NS = 20_000  # a run-ahead host's time from one NCCL call to the next (its launches between)
RETURN_NS = 3_000  # a run-ahead NCCL call's time on the host


@dataclass(frozen=True)
class Scenario:
    world_size: int
    tp: int = 1
    pp: int = 1
    steps: int = 20
    microbatches: int = 2
    tp_calls: int = 2  # TP AllReduces per forward and per backward of one microbatch
    compute_us: float = 500.0  # compute before each call
    jitter: float = 0.03  # relative spread of each compute chunk
    heterogeneity: float = 0.005  # relative spread of the ranks' constant speeds (no two GPUs are equal)
    transfer_us: float = 40.0  # a collective's own time once every member arrived
    ranks_per_node: int = 8
    clock_skew_us: float = 0.0  # each node's clock is off by up to +- this
    gpu_timing: bool = False
    stragglers: tuple[tuple[int, float], ...] = ()  # (rank, slowdown): 0.1 = 10% slower compute
    slow_from_step: int = 0
    slow_link: tuple[int, int] | None = None  # two pipeline neighbours
    link_latency_us: float = 0.0
    hang_rank: int | None = None
    hang_at_call: int = 0  # the rank stops before its n-th NCCL call (1-based)
    stuck_rank: int | None = None
    stuck_at_call: int = 0  # the rank's n-th NCCL call never completes
    seed: int = 0
    # the host runs ahead of its GPU (real NCCL): calls return at once and the host blocks only at the
    # step's end (the loss); GPU start/end keep the lock-step model's times. In a hang the hosts of GPUs
    # that wait forever go on calling (those calls never start on the GPU) up to that step's end.
    run_ahead: bool = False


@dataclass(frozen=True)
class Truth:
    """What a perfect analyzer reports: the fault kinds and the ranks behind them."""

    kinds: tuple[str, ...]
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]


@dataclass
class SyntheticRun:
    scenario: Scenario
    trace: Trace
    truth: Truth
    parents: dict[int, int] = field(default_factory=dict)  # communicator -> parent it was split from


def _comm_ids(kind: int, groups: int) -> np.ndarray:
    """Stable 64-bit communicator ids (splitmix64 of kind and group index)."""
    z = (np.arange(groups, dtype=np.uint64) + np.uint64(kind << 32)) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class _Recorder:
    """Per-rank call matrices filled one phase at a time."""

    FIELDS = ("comm", "seq", "op", "count", "peer", "comm_rank", "comm_size", "t_call", "t_return",
              "gpu_start", "gpu_end", "group")  # fmt: skip

    def __init__(self, world: int, capacity: int) -> None:
        self.columns = {name: np.zeros((world, capacity), CALL_DTYPE[name]) for name in self.FIELDS}
        self.n = np.zeros(world, np.int64)

    def add(self, ranks: np.ndarray, **values: np.ndarray | int) -> None:
        slot = self.n[ranks]
        for name, value in values.items():
            self.columns[name][ranks, slot] = value[ranks] if isinstance(value, np.ndarray) else value
        self.n[ranks] += 1


def generate(s: Scenario) -> SyntheticRun:
    layout = Layout(s.tp, s.pp, s.world_size)
    world, dp = s.world_size, layout.dp
    rng = np.random.default_rng(s.seed)
    rank = np.arange(world)
    tp_c, dp_c, pp_c = rank % s.tp, (rank // s.tp) % dp, rank // (s.tp * dp)
    kinds = {  # name -> (communicator of each rank, rank in it, size)
        "world": (_comm_ids(1, 1)[np.zeros(world, np.int64)], rank, world),
        "tp": (_comm_ids(2, world // s.tp)[rank // s.tp], tp_c, s.tp),
        "dp": (_comm_ids(3, s.tp * s.pp)[tp_c + s.tp * pp_c], dp_c, dp),
        "pp": (_comm_ids(4, s.tp * dp)[tp_c + s.tp * dp_c], pp_c, s.pp),
    }
    used = ["world"] + [k for k, size in (("tp", s.tp), ("dp", dp), ("pp", s.pp)) if size > 1]
    per_step = s.microbatches * 2 * (s.tp_calls if s.tp > 1 else 0) + (dp > 1) + 1
    per_step += s.microbatches * 2 * 2 * (s.pp > 1)
    recorder = _Recorder(world, per_step * s.steps)

    speed = 1 + s.heterogeneity * rng.standard_normal(world)
    slow = np.zeros(world)
    for who, slowdown in s.stragglers:
        slow[who] = slowdown
    node = rank // s.ranks_per_node
    skew = rng.uniform(-1, 1, node.max() + 1)[node] * s.clock_skew_us * 1e3
    link = np.zeros((max(s.pp - 1, 1), s.tp * dp))  # extra latency between stage i and i+1 of each column
    if s.slow_link:
        a, b = sorted(s.slow_link)
        if pp_c[b] - pp_c[a] != 1 or tp_c[a] != tp_c[b] or dp_c[a] != dp_c[b]:
            raise ValueError(f"slow link {a}<->{b}: the model has links only between pipeline neighbours")
        link[pp_c[a], tp_c[a] + s.tp * dp_c[a]] = s.link_latency_us * 1e3

    ready = np.zeros(world)  # true time each rank is free, ns since the start
    host = np.zeros(world)  # a run-ahead host's clock, ns since the start
    stopped = np.zeros(world, bool)  # a host that makes no more calls (hang; run-ahead: waits in its sync)
    blocked = np.zeros(world, bool)  # a GPU inside a call that never completes (synchronous: its host too)
    group_counter = [0]

    def arrive(step: int) -> np.ndarray:
        factor = speed * (1 + (slow if step >= s.slow_from_step else 0))
        chunk = s.compute_us * 1e3 * factor * np.maximum(0.2, 1 + s.jitter * rng.standard_normal(world))
        return ready + chunk

    def stops_now() -> None:
        if s.hang_rank is not None and not blocked[s.hang_rank] and recorder.n[s.hang_rank] + 1 >= s.hang_at_call:
            stopped[s.hang_rank] = True

    def times(done: np.ndarray, arrival: np.ndarray, ok: np.ndarray) -> dict[str, np.ndarray]:
        """Call, return (0: never) and GPU times; the ranks that returned are free again."""
        exit_ns = done + rng.uniform(0, 2_000, world)
        result = {"t_call": arrival, "t_return": np.where(ok, exit_ns, 0)}
        if s.run_ahead:  # launched ahead of the GPU, returned at once
            next_launch = host + HOST_CALL_NS * rng.uniform(0.5, 1.5, world)
            called = np.where(blocked, next_launch, np.minimum(next_launch, arrival))  # a stuck GPU sets no pace
            result = {"t_call": called, "t_return": called + RETURN_NS}
            host[:] = called + RETURN_NS
        if s.gpu_timing:  # a GPU stuck in an earlier call never reaches this one
            result |= {"gpu_start": np.where(blocked, 0, arrival + LAUNCH_NS), "gpu_end": np.where(ok, done, 0)}
            if s.run_ahead:  # as the ring loader reads a GPU-timed call whose GPU work has not ended: in flight
                result["t_return"] = np.where(ok, result["t_return"], 0)
        ready[:] = np.where(ok, exit_ns, ready)
        return result

    def calling() -> np.ndarray:
        """The ranks whose host makes the next call."""
        return ~stopped if s.run_ahead else ~(stopped | blocked)

    def collective(kind: str, op: Op, count: int, step: int) -> None:
        comm, comm_rank, size = kinds[kind]
        arrival = arrive(step)
        stops_now()
        absent = stopped | blocked  # never arrives on the GPU
        shape = {"world": (1, world), "tp": (world // s.tp, s.tp), "dp": (s.pp, dp, s.tp), "pp": None}[kind]
        axis = 1
        last = arrival.reshape(shape).max(axis=axis, keepdims=True)
        incomplete = absent.reshape(shape).any(axis=axis, keepdims=True)
        if s.stuck_rank is not None and recorder.n[s.stuck_rank] + 1 >= s.stuck_at_call and not absent[s.stuck_rank]:
            stuck_group = np.zeros(world, bool)
            stuck_group[s.stuck_rank] = True
            incomplete = incomplete | stuck_group.reshape(shape).any(axis=axis, keepdims=True)
        done = last + s.transfer_us * 1e3 * rng.uniform(0.9, 1.1, last.shape)
        done = np.broadcast_to(done, shape).reshape(world)
        ok = ~np.broadcast_to(incomplete, shape).reshape(world)
        present = np.flatnonzero(calling())
        values = times(done, arrival, ok)
        if s.gpu_timing and s.stuck_rank is not None and not ok[s.stuck_rank] and not absent[s.stuck_rank]:
            values["gpu_start"] = values["gpu_start"].copy()
            values["gpu_start"][s.stuck_rank] = 0
        recorder.add(present, comm=comm, seq=recorder_seq[kind] + 1, op=int(op), count=count, peer=-1,
                     comm_rank=comm_rank, comm_size=size, **values)  # fmt: skip
        recorder_seq[kind][present] += 1
        blocked[present[~ok[present]]] = True

    def exchange(forward: bool, step: int) -> None:
        """Grouped Recv from the previous stage and Send to the next one (reversed going backward)."""
        comm, stage, _ = kinds["pp"]
        arrival = arrive(step)
        stops_now()
        absent = stopped | blocked
        columns = s.tp * dp
        arr, gone = arrival.reshape(s.pp, columns), absent.reshape(s.pp, columns)
        transfer = s.transfer_us * 1e3 * rng.uniform(0.9, 1.1, (s.pp - 1, columns)) + link
        pair_done = np.maximum(arr[:-1], arr[1:]) + transfer  # between stage i and i+1
        pair_ok = ~(gone[:-1] | gone[1:])
        done = np.full((s.pp, columns), -np.inf)  # stage i uses the links to i-1 and to i+1
        ok = np.ones((s.pp, columns), bool)
        done[:-1] = pair_done
        done[1:] = np.maximum(done[1:], pair_done)
        ok[:-1] &= pair_ok
        ok[1:] &= pair_ok
        done, ok = done.reshape(world), ok.reshape(world)
        group_counter[0] += 1
        values = times(done, arrival, ok)
        present = calling()
        for towards_next, op in ((not forward, Op.RECV), (forward, Op.SEND)):  # receive first, as NCCL groups do
            has_peer = stage < s.pp - 1 if towards_next else stage > 0
            who = np.flatnonzero(present & has_peer)
            counter = p2p_seq[(towards_next, op)]
            recorder.add(who, comm=comm, seq=counter + 1, op=int(op), count=4096, comm_rank=stage, comm_size=s.pp,
                         peer=stage + (1 if towards_next else -1), group=group_counter[0], **values)  # fmt: skip
            counter[who] += 1
        blocked[present & ~ok] = True

    recorder_seq = {kind: np.zeros(world, np.int64) for kind in kinds}
    p2p_seq = {(towards, op): np.zeros(world, np.int64) for towards in (True, False) for op in (Op.SEND, Op.RECV)}
    for step in range(s.steps):
        for forward in (True, False):
            for _ in range(s.microbatches):
                for _ in range(s.tp_calls if s.tp > 1 else 0):
                    collective("tp", Op.ALLREDUCE, 1 << 20, step)
                if s.pp > 1:
                    exchange(forward, step)
        if dp > 1:
            collective("dp", Op.ALLREDUCE, 1 << 24, step)
        collective("world", Op.ALLREDUCE, 1, step)
        host[:] = np.maximum(host, ready)  # the loss's .item(): the host waits for its GPU
        if s.run_ahead:
            stopped |= blocked  # ... forever when its GPU never completes

    trace = _to_trace(s, recorder, skew, kinds, used, layout)
    world_id = int(kinds["world"][0][0])
    return SyntheticRun(s, trace, _truth(s, trace), {c: world_id for c in trace.comms if c != world_id})


def _to_trace(
    s: Scenario, recorder: _Recorder, skew: np.ndarray, kinds: dict, used: list[str], layout: Layout
) -> Trace:
    world = s.world_size
    valid = np.arange(recorder.columns["comm"].shape[1])[None, :] < recorder.n[:, None]
    calls = np.zeros(int(valid.sum()), CALL_DTYPE)
    calls["rank"] = np.broadcast_to(np.arange(world)[:, None], valid.shape)[valid]
    for name, matrix in recorder.columns.items():
        calls[name] = matrix[valid]
    calls["dtype"] = 7  # ncclFloat32
    offset = np.round(skew[calls["rank"]]).astype(np.int64)
    base = np.int64(START_NS)
    for name in ("t_call", "t_return", "gpu_start", "gpu_end"):
        column = calls[name]
        column[column > 0] += base + offset[column > 0]
    comms: dict[int, Communicator] = {}
    for kind in used:
        ids, comm_rank, size = kinds[kind]
        for global_rank, comm_id, position in zip(range(world), ids.tolist(), comm_rank.tolist(), strict=True):
            comms.setdefault(comm_id, Communicator(comm_id, size)).members[position] = global_rank
    ranks = {r: RankSource(r, f"node-{r // s.ranks_per_node}", 1000 + r, "") for r in range(world)}
    return Trace(calls, ranks, comms, layout=layout)


def _truth(s: Scenario, trace: Trace) -> Truth:
    kinds: list[str] = []
    ranks: list[int] = []
    if s.hang_rank is not None:
        kinds, ranks = ["hang"], [s.hang_rank]
    elif s.stuck_rank is not None:
        kinds, ranks = ["hang"], [s.stuck_rank]
    else:
        if s.slow_link:
            kinds.append("slow_link")
            ranks += sorted(s.slow_link)
        if s.stragglers:
            kinds.append("straggler")
            ranks += sorted(rank for rank, _ in s.stragglers)
            if s.slow_from_step:
                kinds.append("fail_slow")
    return Truth(tuple(kinds), tuple(ranks), tuple(sorted({trace.node_of(r) for r in ranks})))
