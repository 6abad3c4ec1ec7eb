"""`rankwatch simulate`: a Megatron-shaped job on the stand-in NCCL, traced by the real interposer.

Starts ``world_size`` processes of ``nccl_patch/drivers/megatron_step`` with librankwatch-nccl.so
preloaded, injects at most one fault into the chosen rank(s) and leaves each rank's ring file in the
output directory, with ``simulation.json`` describing the run (layout, faults, rank -> node, ring).
A run with a hang ends once every ring has been still for ``settle`` seconds; the processes are then
killed, as an operator would after diagnosis.

``device`` picks the stand-in GPU model (``RANKWATCH_STANDIN_DEVICE``): ``async`` (the default
everywhere) runs kernels and collectives on per-stream executors behind the host, as a real GPU does
(nccl_patch/standin/cuda_standin.c); ``sync`` performs each inside the call that launches it, for
comparison. GPU timing is on by default, as ``spec.tracing.gpuTiming``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rankwatch.standins import noisy_neighbour
from rankwatch.standins.native import native_artifacts


class SimulationError(RuntimeError):
    """The simulation could not run as asked; the message says why."""


DEVICE_MODELS = ("sync", "async")
DEVICE_VARIABLE = "RANKWATCH_STANDIN_DEVICE"
DEFAULT_DEVICE = "async"
"""The stand-in GPU when nothing (--device, RANKWATCH_STANDIN_DEVICE, Simulation.device) says: the GPU runs
behind the host."""


def _check_device(device: str) -> None:
    if device not in DEVICE_MODELS:
        raise SimulationError(f"--device {device!r}: choose one of {', '.join(DEVICE_MODELS)}")


@dataclass(frozen=True)
class HostCost:
    """The CPU time the driver's host spends, as a real PyTorch host does (nccl_patch/drivers/megatron_step.c):
    per launched op (Python, dispatcher, launch), a compute chunk standing for one kernel per ``kernel_us``
    of GPU time, and per step (optimizer bookkeeping, the next batch). Real CPU work, so a host starved of
    CPU launches late and its GPU idles. None keeps the driver's default: no host cost, 500 us kernels
    (launch_us=20, step_us=500 keeps the host busy ~5% of its GPU's time: the starved-host e2e's)."""

    launch_us: int | None = None
    step_us: int | None = None
    kernel_us: int | None = None

    def validate(self) -> None:
        for flag, value, least in (
            ("--host-us-per-launch", self.launch_us, 0),
            ("--host-us-per-step", self.step_us, 0),
            ("--kernel-us", self.kernel_us, 1),
        ):
            if value is not None and value < least:
                raise SimulationError(f"{flag} {value}: must be at least {least}")

    def driver_args(self) -> list[str]:
        """The driver's flags for the values that are set."""
        flags = (("--host-us-per-launch", self.launch_us), ("--host-us-per-step", self.step_us),
                 ("--kernel-us", self.kernel_us))  # fmt: skip
        return [part for flag, value in flags if value is not None for part in (flag, str(value))]


MISMATCH_KINDS = ("op", "count", "dtype")
"""What the mismatched call changes (RANKWATCH_STANDIN_MISMATCH, nccl_patch/standin/faults.h): a broadcast
where the peers all-reduce, half their element count, another datatype."""


@dataclass
class Faults:
    slow_rank: int | None = None
    slowdown: float = 0.0
    slow_from_call: int = 0  # the slowdown starts after this many NCCL calls (fail-slow onset)
    hang_rank: int | None = None
    hang_at: int = 0
    stuck_rank: int | None = None  # async device: its N-th NCCL operation never starts on its GPU (peers' do)
    stuck_at: int = 0
    never_ends_rank: int | None = None  # async device: its N-th operation starts like its peers' and never ends
    never_ends_at: int = 0
    slow_link: tuple[int, int] | None = None
    link_latency_us: int = 0
    device_stop_rank: int | None = None  # that rank's GPU stops inside its N-th compute kernel
    device_stop_at_kernel: int = 0
    mismatch_rank: int | None = None  # its first all-reduce from its N-th NCCL call on is another collective
    mismatch_at: int = 0
    mismatch: str = "op"  # what differs: MISMATCH_KINDS

    def env_for(self, rank: int) -> dict[str, str]:
        env: dict[str, str] = {}
        if self.slow_rank == rank and self.slowdown > 0:
            env["RANKWATCH_STANDIN_SLOWDOWN"] = str(self.slowdown)
            env["RANKWATCH_STANDIN_SLOWDOWN_FROM_CALL"] = str(self.slow_from_call)
        if self.hang_rank == rank and self.hang_at > 0:
            env["RANKWATCH_STANDIN_HANG_BEFORE_CALL"] = str(self.hang_at)
        if self.stuck_rank == rank and self.stuck_at > 0:
            env["RANKWATCH_STANDIN_STUCK_IN_CALL"] = str(self.stuck_at)
        if self.never_ends_rank == rank and self.never_ends_at > 0:
            env["RANKWATCH_STANDIN_NEVER_ENDS_CALL"] = str(self.never_ends_at)
        if self.device_stop_rank == rank and self.device_stop_at_kernel > 0:
            env["RANKWATCH_STANDIN_DEVICE_STOP_AT_KERNEL"] = str(self.device_stop_at_kernel)
        if self.mismatch_rank == rank and self.mismatch_at > 0:
            env["RANKWATCH_STANDIN_MISMATCH_AT_CALL"] = str(self.mismatch_at)
            env["RANKWATCH_STANDIN_MISMATCH"] = self.mismatch
        if self.slow_link and rank in self.slow_link and self.link_latency_us > 0:
            other = self.slow_link[1] if rank == self.slow_link[0] else self.slow_link[0]
            env["RANKWATCH_STANDIN_LINK_PEER"] = str(other)
            env["RANKWATCH_STANDIN_LINK_LATENCY_US"] = str(self.link_latency_us)
        return env

    @property
    def hangs(self) -> bool:
        return (
            (self.hang_rank is not None and self.hang_at > 0)
            or (self.stuck_rank is not None and self.stuck_at > 0)
            or (self.never_ends_rank is not None and self.never_ends_at > 0)
            or (self.device_stop_rank is not None and self.device_stop_at_kernel > 0)
            or (self.mismatch_rank is not None and self.mismatch_at > 0)  # mismatched members never complete
        )


@dataclass
class Simulation:
    world_size: int
    tp: int = 1
    pp: int = 1
    steps: int = 10
    microbatches: int = 2
    compute_us: int = 2000
    ranks_per_node: int = 8
    gpu_timing: bool = True
    device: str = DEFAULT_DEVICE
    p2p_sync: bool = False  # Megatron's batch_p2p_sync: the host synchronises after each pipeline exchange
    host_cost: HostCost = field(default_factory=HostCost)
    faults: Faults = field(default_factory=Faults)
    timeout: float = 300.0
    settle: float = 2.0

    def validate(self) -> None:
        _check_device(self.device)
        self.host_cost.validate()
        if self.world_size < 1:
            raise SimulationError(f"--world-size must be at least 1, got {self.world_size}")
        if self.tp < 1 or self.pp < 1 or self.world_size % (self.tp * self.pp):
            raise SimulationError(f"--tp {self.tp} x --pp {self.pp} must divide --world-size {self.world_size}")
        if self.faults.mismatch not in MISMATCH_KINDS:
            raise SimulationError(f"--mismatch {self.faults.mismatch!r}: choose one of {', '.join(MISMATCH_KINDS)}")
        for name in ("slow_rank", "hang_rank", "stuck_rank", "never_ends_rank", "device_stop_rank", "mismatch_rank"):
            rank = getattr(self.faults, name)
            if rank is not None and not 0 <= rank < self.world_size:
                raise SimulationError(
                    f"--{name.replace('_', '-')} {rank} is not a rank of a {self.world_size}-rank job"
                )
        if self.faults.slow_link and not all(0 <= r < self.world_size for r in self.faults.slow_link):
            raise SimulationError(f"--slow-link {self.faults.slow_link} names a rank outside the job")

    def node_of(self, rank: int) -> str:
        return f"sim-node-{rank // self.ranks_per_node}"


@dataclass
class RankOutcome:
    rank: int
    pid: int
    node: str
    ring: str | None
    exit_code: int | None  # None: killed by the launcher after the run settled


def _rings_by_pid(out: Path) -> dict[int, Path]:
    rings = {}
    for path in out.glob("rankwatch-*.ring"):
        try:
            rings[int(path.stem.rsplit("-", 1)[1])] = path
        except ValueError:
            continue
    return rings


def _ring_progress(rings: dict[int, Path]) -> tuple[int, ...]:
    from rankwatch.analysis.ring import RingError, RingReader

    progress = []
    for path in rings.values():
        try:
            with RingReader(path) as reader:
                header = reader.header()
                progress.append(header.claimed)
        except RingError:
            progress.append(-1)
    return tuple(progress)


def run(simulation: Simulation, out: Path, log=print) -> list[RankOutcome]:
    """Run the job; return one outcome per rank. Raises SimulationError on unexpected failures."""
    simulation.validate()
    artifacts = native_artifacts()
    out.mkdir(parents=True, exist_ok=True)
    rendezvous = out / ".rendezvous"
    rendezvous.mkdir(exist_ok=True)
    for stale in rendezvous.glob("*.id"):
        stale.unlink()
    session = uuid.uuid4().hex[:12]
    base_env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("RANKWATCH_STANDIN_", "NCCL_MEGATRACE_")) and key not in ("RANK", "LD_PRELOAD")
    }
    library_path = ":".join(filter(None, [str(artifacts.standin_dir), os.environ.get("LD_LIBRARY_PATH")]))
    processes: list[tuple[int, subprocess.Popen]] = []
    started = time.monotonic()
    for rank in range(simulation.world_size):
        env = {
            **base_env,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % simulation.ranks_per_node),
            "WORLD_SIZE": str(simulation.world_size),
            "LD_PRELOAD": str(artifacts.interposer),
            "LD_LIBRARY_PATH": library_path,
            "RANKWATCH_TRACE_DIR": str(out),
            "RANKWATCH_NODE_NAME": simulation.node_of(rank),
            "RANKWATCH_STANDIN_SESSION": session,
            "RANKWATCH_GPU_TIMING": "1" if simulation.gpu_timing else "0",
            DEVICE_VARIABLE: simulation.device,
            **simulation.faults.env_for(rank),
        }
        argv = [
            str(artifacts.megatron_driver), "--rendezvous", str(rendezvous),
            "--tp", str(simulation.tp), "--pp", str(simulation.pp), "--steps", str(simulation.steps),
            "--microbatches", str(simulation.microbatches), "--compute-us", str(simulation.compute_us),
        ] + (["--p2p-sync"] if simulation.p2p_sync else []) + simulation.host_cost.driver_args()  # fmt: skip
        with open(out / f"rank-{rank}.log", "wb") as rank_log:
            processes.append((rank, subprocess.Popen(argv, env=env, stdout=rank_log, stderr=subprocess.STDOUT)))

    exit_codes: dict[int, int | None] = {}
    last_progress: tuple[int, ...] = ()
    still_since = time.monotonic()
    try:
        while True:
            for rank, process in processes:
                if rank not in exit_codes and process.poll() is not None:
                    exit_codes[rank] = process.returncode
            if len(exit_codes) == len(processes):
                break
            elapsed = time.monotonic() - started
            if elapsed > simulation.timeout:
                raise SimulationError(f"the run did not finish within {simulation.timeout:.0f} s")
            rings = _rings_by_pid(out)
            progress = _ring_progress(rings)
            all_started = all(process.pid in rings for _, process in processes)
            if progress != last_progress or not all_started:
                last_progress, still_since = progress, time.monotonic()
            elif simulation.faults.hangs and time.monotonic() - still_since > simulation.settle:
                log(f"no progress for {simulation.settle:.1f} s: the injected hang holds; stopping the ranks")
                break
            time.sleep(0.1)
    finally:
        for _, process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait()
        for segment in Path("/dev/shm").glob(f"rwnccl-{session}-*"):
            segment.unlink(missing_ok=True)

    rings = _rings_by_pid(out)
    outcomes = [
        RankOutcome(
            rank=rank,
            pid=process.pid,
            node=simulation.node_of(rank),
            ring=str(rings[process.pid]) if process.pid in rings else None,
            exit_code=exit_codes.get(rank),
        )
        for rank, process in processes
    ]
    (out / "simulation.json").write_text(
        json.dumps(
            {"simulation": asdict(simulation), "ranks": [asdict(o) for o in outcomes], "session": session}, indent=2
        )
    )
    failed = [o for o in outcomes if o.exit_code not in (0, None)]
    if failed:
        first = failed[0]
        tail = (out / f"rank-{first.rank}.log").read_text(errors="replace")[-2000:]
        raise SimulationError(f"rank {first.rank} exited with {first.exit_code}:\n{tail}")
    if not simulation.faults.hangs and any(o.exit_code is None for o in outcomes):
        raise SimulationError("ranks were still running without an injected hang")
    return outcomes


# ---- one pod of a job: what torchrun does for a pod, on the stand-in NCCL ------------------------------
FAULT_PREFIX = "RANKWATCH_STANDIN_"
FAULT_RANK = "RANKWATCH_STANDIN_FAULT_RANK"
FAULT_ATTEMPT = "RANKWATCH_STANDIN_FAULT_ATTEMPT"
RENDEZVOUS = "RANKWATCH_STANDIN_RENDEZVOUS"
CPU_NEIGHBOURS = "RANKWATCH_STANDIN_CPU_NEIGHBOURS"
"""Busy processes sharing the fault rank's CPU (``rankwatch.standins.noisy_neighbour``): a host-starved rank."""
POD_FAULT_VARIABLES = (
    "RANKWATCH_STANDIN_SLOWDOWN",
    "RANKWATCH_STANDIN_SLOWDOWN_FROM_CALL",
    "RANKWATCH_STANDIN_HANG_BEFORE_CALL",
    "RANKWATCH_STANDIN_HANG_WHEN_FILE",
    "RANKWATCH_STANDIN_STUCK_IN_CALL",
    "RANKWATCH_STANDIN_NEVER_ENDS_CALL",
    "RANKWATCH_STANDIN_LINK_PEER",
    "RANKWATCH_STANDIN_LINK_LATENCY_US",
    CPU_NEIGHBOURS,
    "RANKWATCH_STANDIN_DATA_STALL_AT_STEP",
    "RANKWATCH_STANDIN_DEVICE_STOP_AT_KERNEL",
    "RANKWATCH_STANDIN_BACKWARD_SLOWDOWN",
    "RANKWATCH_STANDIN_MISMATCH_AT_CALL",
    "RANKWATCH_STANDIN_MISMATCH",
)


@dataclass
class PodRun:
    """The ranks of one worker pod: ``NODE_RANK`` x ``NPROC_PER_NODE`` ... of ``WORLD_SIZE``."""

    tp: int = 1
    pp: int = 1
    steps: int = 10
    microbatches: int = 2
    compute_us: int = 2000
    python: bool = False  # ranks are Python processes (``rankwatch.standins.python_rank``), not the C driver
    device: str | None = None  # None: RANKWATCH_STANDIN_DEVICE from the pod's environment (else async)
    p2p_sync: bool = False
    host_cost: HostCost = field(default_factory=HostCost)  # the C driver's; a Python rank's host cost is Python's


def _torchrun_setting(environ: dict[str, str], name: str) -> str:
    """``name`` (``NODE_RANK``), else torchrun's own variable for it (``PET_NODE_RANK``, which the Kubeflow
    training-operator sets on a PyTorchJob's pods); KeyError naming ``name`` when neither is set."""
    value = environ.get(name) or environ.get(f"PET_{name}")
    if value is None:
        raise KeyError(name)
    return value


def pod_rank_env(environ: dict[str, str], local_rank: int) -> dict[str, str]:
    """The environment of one rank of this pod: RANK / LOCAL_RANK, the stand-in on the library path,
    and the fault variables only on the rank ``RANKWATCH_STANDIN_FAULT_RANK`` names (all ranks when unset),
    so a job template (the same for every pod) can slow or hang exactly one rank of the job; with
    ``RANKWATCH_STANDIN_FAULT_ATTEMPT`` only in that attempt (``RANKWATCH_ATTEMPT``, after restarts)."""
    try:
        node_rank, nproc = (
            int(_torchrun_setting(environ, "NODE_RANK")),
            int(_torchrun_setting(environ, "NPROC_PER_NODE")),
        )
        int(environ["WORLD_SIZE"])
    except (KeyError, ValueError) as error:
        raise SimulationError(
            f"NODE_RANK, NPROC_PER_NODE and WORLD_SIZE must be set (the operator sets them): {error}"
        ) from None
    rank = node_rank * nproc + local_rank
    env = dict(environ)
    fault_rank, fault_attempt = environ.get(FAULT_RANK), environ.get(FAULT_ATTEMPT)
    other_attempt = fault_attempt not in (None, "") and fault_attempt != environ.get("RANKWATCH_ATTEMPT", "0")
    if other_attempt or (fault_rank not in (None, "") and int(fault_rank) != rank):
        for name in POD_FAULT_VARIABLES:
            env.pop(name, None)
    artifacts = native_artifacts()
    env["LD_LIBRARY_PATH"] = ":".join(filter(None, [str(artifacts.standin_dir), environ.get("LD_LIBRARY_PATH")]))
    env["RANK"], env["LOCAL_RANK"] = str(rank), str(local_rank)
    return env


def run_pod(pod: PodRun, environ: dict[str, str] | None = None) -> int:
    """Start this pod's ranks of the Megatron-shaped driver, wait, return the first failure's exit code.

    Ranks of all pods meet through files in ``RANKWATCH_STANDIN_RENDEZVOUS`` and the stand-in's shared
    memory (``RANKWATCH_STANDIN_SESSION``): every pod of a job must run on this machine with the same two
    values (the e2e pod runner sets them per job). SIGTERM stops the ranks."""
    environ = dict(os.environ if environ is None else environ)
    pod.host_cost.validate()
    if pod.python and pod.host_cost.driver_args():
        raise SimulationError(
            "--host-us-per-launch, --host-us-per-step and --kernel-us are the C driver's; a --python rank's "
            "host cost is its Python"
        )
    if pod.device is not None:
        _check_device(pod.device)
        environ[DEVICE_VARIABLE] = pod.device
    elif not environ.get(DEVICE_VARIABLE):
        environ[DEVICE_VARIABLE] = DEFAULT_DEVICE
    nproc = int(environ.get("NPROC_PER_NODE") or environ.get("PET_NPROC_PER_NODE") or 0)
    default_dir = f"/tmp/rankwatch-standin/{environ.get('MASTER_ADDR', 'local')}-{environ.get('MASTER_PORT', '0')}"
    rendezvous = Path(environ.get(RENDEZVOUS) or default_dir)
    rendezvous.mkdir(parents=True, exist_ok=True)
    driver = native_artifacts().megatron_driver
    argv = [
        str(driver), "--rendezvous", str(rendezvous), "--tp", str(pod.tp), "--pp", str(pod.pp),
        "--steps", str(pod.steps), "--microbatches", str(pod.microbatches), "--compute-us", str(pod.compute_us),
    ] + (["--p2p-sync"] if pod.p2p_sync else []) + pod.host_cost.driver_args()  # fmt: skip
    if pod.python:
        environ[RENDEZVOUS] = str(rendezvous)
        argv = [sys.executable, "-m", "rankwatch.standins.python_rank", "--steps", str(pod.steps),
                "--compute-us", str(pod.compute_us)]  # fmt: skip
    processes, neighbours = [], []
    for local in range(nproc):
        env = pod_rank_env(environ, local)
        try:
            crowd = int(env.get(CPU_NEIGHBOURS) or 0)
        except ValueError:
            raise SimulationError(f"{CPU_NEIGHBOURS}={env[CPU_NEIGHBOURS]!r}: expected a number of processes") from None
        if crowd > 0:
            cpu = noisy_neighbour.shared_cpu()
            neighbours += noisy_neighbour.start_neighbours(crowd, cpu)
            # only the host is crowded: the stand-in GPU's executors keep the pod's CPUs, as a GPU is not
            # on its host's core (else the device would be starved too, not the host behind it)
            env[noisy_neighbour.DEVICE_CPUS] = noisy_neighbour.cpu_list(os.sched_getaffinity(0))
            processes.append(subprocess.Popen(argv, env=env, preexec_fn=noisy_neighbour.pin_to(cpu)))
        else:
            processes.append(subprocess.Popen(argv, env=env))

    def stop_all() -> None:
        for process in processes + neighbours:
            if process.poll() is None:
                process.kill()

    def stop(signum: int, _frame: object) -> None:
        stop_all()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        codes = [process.wait() for process in processes]
    finally:
        stop_all()
    return next((code for code in codes if code != 0), 0)
