"""The operator's diagnosis side at cluster scale: many jobs' sidecars against one collector.

A child process stands in for the operator's diagnosis side: the real collector (aiohttp app, token
check per job, rate limit, gzip, protocol parsing, dedupe, bounded job state) and the monitor's
detector, run over every job's state once per window on the same event loop, as the monitor does.
Sender processes of their own (``sidecar_load``) play every sidecar of ``--jobs`` jobs: each pod
(8 ranks, 4 communicators per rank: TP 8, DP, PP, world; bench/operator_cpu.py builds them) POSTs one
gzip'd window summary per window with its job's bearer token, window numbers advancing, a pod's next
window only after its previous one is answered, the pods' sends spread over the window as unaligned
sidecars spread them. Requests (head and body) are made before the clock starts and written over
keep-alive connections by a minimal HTTP/1.1 client; the senders' own CPU is measured apart, so the
figures say what the operator used (the senders still share the machine's cores). Steps of growing
total ranks show how each cost grows.

Measured per step, in the child: CPU (``/proc/<pid>/stat``) as a share of one core and per summary,
peak RSS (``VmHWM``), the detector's time per window over all jobs; in the senders: summaries
accepted per second, each POST's latency (over ``--connections`` keep-alive connections: 8,000 real
sidecars would hold 8,000 connections), how far behind their schedule they ran, their own CPU.

Not here: the operator's watches and API traffic (the pods of this bench exist nowhere), so neither
the time for jobs to reach Running nor API requests per second.

Since 2026-11-26 the collector checks bodies in worker processes (``CollectorSettings.parse_workers``,
``--parse-workers``): CPU and memory are the child's with its workers. ``--event-loop uvloop`` runs
the child's loop on uvloop (``RANKWATCH_EVENT_LOOP``).

    python bench/operator_scale.py [--jobs 50] [--steps 4000,16000,64000] [--windows 13] [--window-seconds 5]
                                   [--parse-workers 1] [--default-gc] [--event-loop asyncio|uvloop]
                                   [--senders 2] [--connections 512] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import gzip
import itertools
import multiprocessing
import os
import pickle
import random
import signal
import socket
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import loop_pauses
import sidecar_load
from figures import Figure, emit
from operator_cpu import RANKS_PER_POD, TP, cpu_seconds, summaries

from rankwatch import protocol
from rankwatch.operator import event_loop as loops

NAMESPACE = "bench"


def job_names(jobs: int) -> list[str]:
    return [f"job-{index:02d}" for index in range(jobs)]


PROBE_JOB = "probe"
"""A job of the collector's that only the idle baseline sends to (the detector leaves it out)."""


def token_of(job: str) -> str:
    return f"token-of-{job}"


def layout_of(world: int) -> int:
    """The pipeline size that makes ``world`` ranks a whole TP 8 x DP x PP grid of 8-rank pods."""
    for pipeline in (4, 2, 1):
        if world % (TP * pipeline) == 0:
            return pipeline
    raise SystemExit(f"{world} ranks per job is not a multiple of {TP}")


def job_bodies(
    namespace: str,
    jobs: Sequence[str],
    world: int,
    window: int,
    generator: random.Random,
    nodes: Mapping[str, Sequence[str]] | None = None,
) -> list[tuple[str, int, bytes]]:
    """(job, pod number over all jobs, gzip'd body) of every pod of every job in one window: one job's
    summaries (the protocol module's encoding), renamed per job (job, pods, nodes) as each job's
    sidecars would name them; pod ``i`` of ``job`` on ``nodes[job][i]`` (``gpu-<j>-<i>`` without)."""
    template = summaries(world, window, generator, layout_of(world), namespace=namespace)
    named = f'"namespace":"{namespace}","job":"big"'.encode()
    bodies = []
    for index, job in enumerate(jobs):
        for number, (_, body) in enumerate(template):
            node = nodes[job][number] if nodes is not None else f"gpu-{index:02d}-{number}"
            raw = gzip.decompress(body)
            raw = raw.replace(named, f'"namespace":"{namespace}","job":"{job}"'.encode())
            raw = raw.replace(b'"pod":"big-worker-', f'"pod":"{job}-worker-'.encode())
            raw = raw.replace(f'"node":"gpu-node-{number}"'.encode(), f'"node":"{node}"'.encode())
            bodies.append((job, index * len(template) + number, gzip.compress(raw, compresslevel=5)))
    random.Random(window).shuffle(bodies)  # pods of all jobs interleave, as unaligned sidecars do
    return bodies


def serve(
    ports: multiprocessing.Queue,
    jobs: int,
    world: int,
    window_s: float,
    passes: multiprocessing.Queue,
    stop: Any,
    workers: int,
    tune_collection: bool,
    event_loop: str,
) -> None:
    """The child: collector + detector on one event loop (asyncio's or uvloop's)."""
    from rankwatch.analysis.topology import Layout
    from rankwatch.operator import garbage_collection
    from rankwatch.operator.config import CollectorSettings
    from rankwatch.operator.diagnosis.detect.detector import Thresholds, detect
    from rankwatch.operator.diagnosis.ingest.collector import Collector
    from rankwatch.operator.diagnosis.ingest.job_state import JobStore, StateLimits

    names = set(job_names(jobs))
    limits = StateLimits.for_job(world, world // RANKS_PER_POD)

    async def tokens(namespace: str, name: str, stale: bool = False) -> str | None:
        return token_of(name) if name in names or name == PROBE_JOB else None

    def followed(namespace: str, name: str) -> StateLimits | None:
        return limits if namespace == NAMESPACE and (name in names or name == PROBE_JOB) else None

    async def main() -> None:
        store = JobStore()
        settings = CollectorSettings(host="127.0.0.1", port=0, parse_workers=workers)
        collector = Collector(store, tokens, settings, jobs=followed)
        await collector.start()
        ports.put(collector.port)
        layout = Layout(TP, layout_of(world), world)
        thresholds = Thresholds(300, window_s)
        watch = loop_pauses.PauseWatch()  # the loop's lag, each collection, each detector pass: one clock
        watch.start()
        if tune_collection:  # as the operator does
            garbage_collection.tune()
        while True:  # the monitor: the detector over every job once per window
            await asyncio.sleep(window_s)
            spent, slowest, found = 0.0, 0.0, 0
            for name in sorted(names):
                state = store.peek(NAMESPACE, name)
                if state is not None and state.summaries:
                    one = time.thread_time()  # the detector's CPU, not the summaries served in between
                    with watch.section("detect"):
                        found += len(detect(state, thresholds, layout, time.monotonic()))
                    spent += time.thread_time() - one
                    slowest = max(slowest, time.thread_time() - one)
                    await asyncio.sleep(0)  # as the monitor does: summaries are served between jobs
            seen = watch.take()
            collected = sum(end - start for _, start, end, _ in seen.collections)
            full = sum(generation == 2 for generation, *_ in seen.collections)
            passes.put((spent, slowest, found, collected, full, seen))
            if stop.is_set():
                # What the frozen objects held that only a thaw would free: cyclic garbage kept alive.
                frozen, started = gc.get_freeze_count(), time.thread_time()
                gc.unfreeze()
                held = gc.collect()  # as the operator's thaw does (garbage_collection.thaw)
                thawed = 1e3 * (time.thread_time() - started)
                # The last report: every one before it is whole, the bench may end this process now.
                passes.put({"frozen": frozen, "garbage_held": held, "thaw_cpu_ms": thawed})
                await asyncio.Event().wait()

    loops.run(main(), event_loop)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the collector's message-parsing workers and their fork server)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def tree_cpu_seconds(pid: int) -> tuple[float, float]:
    """(CPU seconds of ``pid`` alone: the event loop, CPU seconds of it and its descendants)."""
    total = 0.0
    for member in process_tree(pid):
        with contextlib.suppress(OSError):
            total += cpu_seconds(member)
    return cpu_seconds(pid), total


def tree_rss_mib(pid: int) -> tuple[float, float]:
    """(current, peak) resident memory of ``pid`` and its descendants together, in MiB (the sum of each
    one's peak: an upper bound)."""
    current = peak = 0.0
    for member in process_tree(pid):
        with contextlib.suppress(OSError):
            one, one_peak = peak_rss_mib(member)
            current, peak = current + one, peak + one_peak
    return current, peak


def peak_rss_mib(pid: int) -> tuple[float, float]:
    """(current, peak) resident memory of ``pid`` in MiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            fields[key] = value
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def send(
    port: int,
    namespace: str,
    tokens: Mapping[str, str],
    windows: list[list[tuple[str, int, bytes]]],
    window_s: float,
    pid: int,
    senders: int,
    connections: int,
) -> tuple[list[sidecar_load.SenderReport], float, list[tuple[float, float]], list[float]]:
    """Play every pod's sidecar of ``namespace``'s jobs (``tokens``: each job's bearer token) from
    ``senders`` processes of their own (``sidecar_load``; each pod always from the same one, so its
    windows go in order), each window's bodies spread over 80% of the window; the senders' reports,
    the start time, and at each window's start (and at the end) the CPU seconds of process ``pid``
    (its loop, with its children) and the resident memory of them all in MiB."""
    context = multiprocessing.get_context("fork")  # the requests are inherited, not pickled
    ready, reports = context.Queue(), context.Queue()
    starts = [context.Queue() for _ in range(senders)]
    processes = []
    for index in range(senders):
        mine = [
            [(position, pod, sidecar_load.request_bytes(port, namespace, job, tokens[job], body))
             for position, (job, pod, body) in enumerate(bodies) if pod % senders == index]
            for bodies in windows
        ]  # fmt: skip
        process = context.Process(
            target=sidecar_load.sender_main,
            args=(port, mine, window_s, len(windows[0]), connections // senders, ready, starts[index], reports),
        )
        process.start()
        processes.append(process)
    for _ in processes:
        ready.get(timeout=60)
    start = time.monotonic() + 0.5
    for queue in starts:
        queue.put(start)
    cpu_marks, rss_marks = [], []
    for window in range(len(windows) + 1):
        time.sleep(max(0.0, start + window * window_s - time.monotonic()))
        cpu_marks.append(tree_cpu_seconds(pid))
        rss_marks.append(tree_rss_mib(pid)[0])
    got = [reports.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(10)
    return got, start, cpu_marks, rss_marks


def idle_latencies(port: int, world: int) -> list[float]:
    """The baseline: each answer's latency, sorted, of the idle collector taking one pod's summary at a
    time (one window of the probe job's pods, over one keep-alive connection, before the load starts)."""
    bodies = job_bodies(NAMESPACE, [PROBE_JOB], world, 1, random.Random(1))
    latencies = []
    with socket.create_connection(("127.0.0.1", port)) as connection:
        for _, _, body in bodies:
            request = sidecar_load.request_bytes(port, NAMESPACE, PROBE_JOB, token_of(PROBE_JOB), body)
            began = time.perf_counter()
            connection.sendall(request)
            answer = b""
            while b"\r\n\r\n" not in answer or len(answer) < answer.index(b"\r\n\r\n") + 4 + _length(answer):
                answer += connection.recv(65536)
            latencies.append(time.perf_counter() - began)
            if answer[9:12] not in (b"200", b"202"):
                raise SystemExit(f"the idle collector answered {answer[:12]!r} to the probe job's summary")
    return sorted(latencies)


def _length(answer: bytes) -> int:
    head = answer[: answer.index(b"\r\n\r\n")].lower()
    for line in head.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def load_figures(
    reports: list[sidecar_load.SenderReport],
    start: float,
    cpu_marks: list[tuple[float, float]],
    pods: int,
    window_count: int,
    window_s: float,
) -> dict[str, Any]:
    """What the senders saw (accepted, refused, unanswered, latency) and what the process under load
    used (CPU per window, from ``send``'s marks plus one after the last answer): the figures both scale
    benches give, with ``statuses`` (count per HTTP status, 0: unanswered) and ``handled``."""
    marks = cpu_marks[: window_count + 1]
    per_window = [after[1] - before[1] for before, after in itertools.pairwise(marks)]
    loop_per_window = [after[0] - before[0] for before, after in itertools.pairwise(marks)]
    steady = per_window[len(per_window) // 2 :]
    statuses: dict[int, int] = {}
    for report in reports:
        for status, count in report.statuses.items():
            statuses[status] = statuses.get(status, 0) + count
    accepted = statuses.get(202, 0) + statuses.get(200, 0)
    unanswered = statuses.get(0, 0)  # connection lost, or not answered within the senders' drain time
    handled = sum(statuses.values()) - unanswered
    ordered = sorted(latency for report in reports for latency in report.latencies)
    ends = [max(report.window_ends[window] for report in reports) for window in range(window_count)]
    durations = [end - (start + window * window_s) for window, end in enumerate(ends) if end]
    elapsed = max(window_count * window_s, max(ends) - start)
    sender_cpu = sum(report.cpu_seconds for report in reports)
    answered = max(handled, 1)
    return {
        "statuses": statuses,
        "handled": handled,
        "elapsed_s": elapsed,
        "accepted_per_s": accepted / elapsed,
        "offered_per_s": pods / window_s,
        "refused": handled - accepted,
        "unanswered": unanswered,
        "p50_ms": 1e3 * ordered[len(ordered) // 2],
        "p99_ms": 1e3 * ordered[int(len(ordered) * 0.99)],
        "max_ms": 1e3 * ordered[-1],
        "send_s_max": max(durations),
        "cpu_share": statistics.mean(per_window) / window_s,
        "cpu_share_steady": statistics.mean(steady) / window_s,
        "cpu_share_worst": max(per_window) / window_s,
        "loop_cpu_share": statistics.mean(loop_per_window) / window_s,
        "cpu_ms_per_summary": 1e3 * (cpu_marks[-1][1] - cpu_marks[0][1]) / answered,
        "loop_ms_per_summary": 1e3 * (cpu_marks[-1][0] - cpu_marks[0][0]) / answered,
        "sender_ms_per_summary": 1e3 * sender_cpu / answered,
        "sender_cpu_share": sender_cpu / elapsed,
        "sender_lag_s": max(report.lag_max for report in reports),
        "held": sum(report.held for report in reports),
    }


def describe_senders(figures: dict[str, Any], senders: int, window_s: float) -> str:
    """One line on the answers and on the senders themselves (were they, not the operator, the limit?)."""
    return (
        f"statuses {figures['statuses']}; slowest window's answers took {figures['send_s_max']:.1f} s of "
        f"{window_s:g} s; senders: {senders} processes, {figures['sender_cpu_share']:.0%} of a core, "
        f"{figures['sender_ms_per_summary']:.3f} ms per summary, at most {figures['sender_lag_s']:.2f} s "
        f"behind their schedule; {figures['held']} windows waited for their pod's previous one"
    )


def breakdown(bodies: list[tuple[str, int, bytes]], world: int) -> str:
    """The collector's per-summary work without HTTP, in this process: gunzip, parse and check, fold into
    the job's state (one job's bodies of one window)."""
    from rankwatch.operator.diagnosis.ingest.job_state import JobStore, StateLimits

    mine = [body for job, _, body in bodies if job == bodies[0][0]]
    protocol.parse_summary(protocol.decode_body(mine[0], protocol.CONTENT_ENCODING))  # the parser is built once
    started = time.perf_counter()
    raws = [protocol.decode_body(body, protocol.CONTENT_ENCODING) for body in mine]
    decoded = time.perf_counter()
    messages = [protocol.parse_summary(raw) for raw in raws]
    parsed = time.perf_counter()
    state = JobStore().get(NAMESPACE, messages[0].job, StateLimits.for_job(world, world // RANKS_PER_POD))
    for message in messages:
        state.add_summary(message)
    kept = time.perf_counter()
    count = len(mine) / 1e3
    return (f"per summary without HTTP: gunzip {(decoded - started) / count:.2f} ms, parse and check "
            f"{(parsed - decoded) / count:.2f} ms, job state {(kept - parsed) / count:.2f} ms")  # fmt: skip


def step(args: argparse.Namespace, ranks: int) -> list[dict[str, float | str]]:
    """One step of ``ranks`` total ranks over ``args.jobs`` jobs, once per event loop of ``--event-loop``
    (in that order, on the same bodies): their figures."""
    jobs, window_count = args.jobs, args.windows
    world = max(TP, round(ranks / jobs / TP) * TP)
    built = time.monotonic()
    cached = args.keep / f"bodies-{jobs}x{world}x{window_count}.pickle" if args.keep else None
    if cached is not None and cached.exists():
        windows = pickle.loads(cached.read_bytes())  # the same bodies as made below (seeded)
    else:
        generator = random.Random(0)
        windows = [
            job_bodies(NAMESPACE, job_names(jobs), world, number + 1, generator) for number in range(window_count)
        ]
        if cached is not None:
            cached.write_bytes(pickle.dumps(windows))
    pods = len(windows[0])
    size = sum(len(body) for *_, body in windows[0]) / pods
    print(f"\n{jobs} jobs x {world} ranks = {jobs * world} ranks, {pods} pods; built {window_count} windows in "
          f"{time.monotonic() - built:.0f} s; {size / 1024:.1f} KiB per summary",
          flush=True)  # fmt: skip

    print(breakdown(windows[0], world), flush=True)
    return [run(args, world, windows, loop) for loop in args.event_loop.split(",")]


def run(
    args: argparse.Namespace, world: int, windows: list[list[tuple[str, int, bytes]]], event_loop: str
) -> dict[str, float | str]:
    """One run of the collector's child (on ``event_loop``) against the senders: its figures."""
    jobs, window_count, window_s = args.jobs, args.windows, args.window_seconds
    pods = len(windows[0])
    load_before = os.getloadavg()[0]
    context = multiprocessing.get_context("spawn")
    ports, passes, stop = context.Queue(), context.Queue(), context.Event()
    child = context.Process(
        target=serve,
        args=(ports, jobs, world, window_s, passes, stop, args.parse_workers, not args.default_gc, event_loop),
    )
    child.start()
    try:
        port = ports.get(timeout=60)
        time.sleep(1.0)
        _, idle_rss = tree_rss_mib(child.pid)
        idle = idle_latencies(port, world)
        tokens = {job: token_of(job) for job in job_names(jobs)}
        reports, start, cpu_marks, _ = send(
            port, NAMESPACE, tokens, windows, window_s, child.pid, args.senders, args.connections
        )
        cpu_marks.append(tree_cpu_seconds(child.pid))  # after the last answer: all the work of every summary
        stop.set()  # one more detector pass over the full state, then its last report and the end mark
        detector = []
        while not isinstance(one := passes.get(timeout=max(60.0, 3 * window_s)), dict):
            detector.append(one)
        ended = one
        rss, peak = tree_rss_mib(child.pid)
    finally:
        members = process_tree(child.pid)
        for member in reversed(members):  # the parsing workers and their fork server, then the child
            with contextlib.suppress(OSError):
                os.kill(member, signal.SIGTERM)
        child.join(10)
    load = load_figures(reports, start, cpu_marks, pods, window_count, window_s)
    pauses = loop_pauses.summary(loop_pauses.merged([seen for *_, seen in detector]))
    figures: dict[str, float | str] = {
        "loop": event_loop,
        "load": load_before,
        "load_after": os.getloadavg()[0],
        "ranks": jobs * world,
        "pods": pods,
        **{key: value for key, value in load.items() if key != "statuses"},
        "idle_p50_ms": 1e3 * idle[len(idle) // 2],
        "idle_p99_ms": 1e3 * idle[int(len(idle) * 0.99)],
        "rss_idle_mib": idle_rss,
        "rss_mib": rss,
        "peak_rss_mib": peak,
        "detect_ms": 1e3 * statistics.mean(row[0] for row in detector[-3:]) if detector else float("nan"),
        "detect_ms_max": 1e3 * max(row[0] for row in detector) if detector else float("nan"),
        "detect_job_ms_max": 1e3 * max(row[1] for row in detector) if detector else float("nan"),
        "gc_ms": 1e3 * statistics.mean(row[3] for row in detector) if detector else float("nan"),
        "full_gc": sum(row[4] for row in detector) / len(detector) if detector else float("nan"),
        "suspicions": sum(row[2] for row in detector),
        **pauses,
        **ended,
    }
    print(f"load average {os.getloadavg()[0]:.1f}; {describe_senders(load, args.senders, window_s)}", flush=True)
    print(describe_pauses(figures), flush=True)
    return figures


def describe_pauses(figures: dict[str, Any]) -> str:
    """Where the answers' tail comes from: the loop's lag, its pauses and the longest of them laid against
    the collections (per generation) and the detector's passes that ran within them."""
    collections = ", ".join(
        f"gen {g} {figures[f'gc{g}_count']} x, {figures[f'gc{g}_ms']:.0f} ms, "
        f"longest {figures[f'gc{g}_max_ms']:.0f} ms (CPU {figures[f'gc{g}_cpu_max_ms']:.0f} ms)"
        for g in range(3)
    )
    return (
        f"answers p99 {figures['p99_ms']:.1f} ms, the idle collector's p50 / p99 {figures['idle_p50_ms']:.1f} / "
        f"{figures['idle_p99_ms']:.1f} ms (ratio {figures['p99_ms'] / figures['idle_p50_ms']:.1f}); loop lag p50 / "
        f"p99 / max {figures['lag_p50_ms']:.1f} / {figures['lag_p99_ms']:.1f} / {figures['lag_max_ms']:.0f} ms, "
        f"{figures['pauses']} pauses >= {1e3 * loop_pauses.PAUSE_S:.0f} ms, {figures['pauses_ms']:.0f} ms in all, of "
        f"which {figures['pauses_queued_ms']:.0f} ms waiting for a CPU; collections: {collections}; detector: "
        f"{figures.get('detect_count', 0)} job passes, longest {figures.get('detect_max_ms', 0):.1f} ms (wall); "
        f"longest pauses: {figures['longest_pauses'] or 'none'}; at the end {figures['frozen']} objects frozen, "
        f"of which {figures['garbage_held']} unreachable (cyclic garbage only a thaw frees); thawing and "
        f"collecting them all took {figures['thaw_cpu_ms']:.0f} ms of CPU"
    )


def emit_figures(row: dict[str, Any]) -> None:
    """The headline figures of one run (bench/figures.py): the answers' p99 against the idle collector's
    p50 measured in the same run, the share of the offered summaries taken, the peak memory."""
    ranks = f"{row['ranks']}_ranks"
    emit(Figure(f"operator.scale.answer_p99.{ranks}", row["p99_ms"], "ms", row["idle_p50_ms"], "idle collector p50"))
    emit(Figure(f"operator.scale.accepted_share.{ranks}", row["accepted_per_s"] / row["offered_per_s"], "share"))
    emit(Figure(f"operator.scale.peak_rss.{ranks}", row["peak_rss_mib"] / 1024, "GiB"))


LOAD_COLUMNS = [  # header, figure, format, scale: what the senders and the operator's CPU say of one run
    ("acc/s", "accepted_per_s", ">6.0f", 1),
    ("offered", "offered_per_s", ">7.0f", 1),
    ("refused", "refused", ">7.0f", 1),
    ("unanswered", "unanswered", ">10.0f", 1),
    ("p50 ms", "p50_ms", ">7.1f", 1),
    ("p99 ms", "p99_ms", ">7.1f", 1),
    ("CPU%", "cpu_share", ">5.0f", 100),
    ("steady", "cpu_share_steady", ">6.0f", 100),
    ("worst", "cpu_share_worst", ">5.0f", 100),
    ("loop%", "loop_cpu_share", ">5.0f", 100),
]


def print_table(rows: list[dict], columns: list[tuple[str, str, str, float]]) -> None:
    """One line per row, one column per (header, figure, format, scale)."""
    print(" ".join(f"{header:>{len(format(0, spec))}}" for header, _, spec, _ in columns))
    for row in rows:
        print(" ".join(format(row[key] * scale, spec) for _, key, spec, scale in columns))


PAUSE_COLUMNS = [  # header, figure, format, scale: where the tail comes from
    ("ranks", "ranks", ">6.0f", 1),
    ("p99 ms", "p99_ms", ">7.1f", 1),
    ("idle p50", "idle_p50_ms", ">8.1f", 1),
    ("idle p99", "idle_p99_ms", ">8.1f", 1),
    ("lag p99", "lag_p99_ms", ">7.1f", 1),
    ("lag max", "lag_max_ms", ">7.0f", 1),
    ("pauses", "pauses", ">6.0f", 1),
    ("in ms", "pauses_ms", ">6.0f", 1),
    ("queued", "pauses_queued_ms", ">6.0f", 1),
    ("gen0 n", "gc0_count", ">6.0f", 1),
    ("max ms", "gc0_max_ms", ">6.0f", 1),
    ("gen1 n", "gc1_count", ">6.0f", 1),
    ("max ms", "gc1_max_ms", ">6.0f", 1),
    ("gen2 n", "gc2_count", ">6.0f", 1),
    ("max ms", "gc2_max_ms", ">6.0f", 1),
    ("CPU ms", "gc2_cpu_max_ms", ">6.0f", 1),
    ("det job max", "detect_max_ms", ">11.1f", 1),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--steps", default="4000,16000,64000", help="total ranks of each step")
    parser.add_argument("--windows", type=int, default=13, help="windows per step (the state keeps 12)")
    parser.add_argument("--window-seconds", type=float, default=5.0)
    parser.add_argument("--default-gc", action="store_true", help="Python's GC thresholds, not the operator's")
    parser.add_argument("--parse-workers", type=int, default=1, help="the collector's parsing processes (0: none)")
    parser.add_argument(
        "--event-loop", default="asyncio", help="the collector's loop: asyncio, uvloop, or several (asyncio,uvloop)"
    )
    parser.add_argument("--senders", type=int, default=2, help="processes playing the sidecars")
    parser.add_argument("--connections", type=int, default=512, help="keep-alive connections over all senders")
    parser.add_argument("--keep", type=Path, help="a folder where the bodies made once are kept for later runs")
    args = parser.parse_args()
    steps = [int(ranks) for ranks in args.steps.split(",")]
    for name in args.event_loop.split(","):
        try:
            loops.loop_factory(name)
        except ValueError as error:
            parser.error(f"--event-loop {name}: {error}")
    rows = [row for ranks in steps for row in step(args, ranks)]
    columns = [  # header, figure, format, scale
        ("event loop", "loop", ">10", 1),
        ("load", "load", ">4.1f", 1),
        ("after", "load_after", ">5.1f", 1),
        ("ranks", "ranks", ">6.0f", 1),
        ("pods", "pods", ">5.0f", 1),
        *LOAD_COLUMNS,
        ("ms/sum", "cpu_ms_per_summary", ">6.2f", 1),
        ("loop", "loop_ms_per_summary", ">5.2f", 1),
        ("snd%", "sender_cpu_share", ">4.0f", 100),
        ("snd ms", "sender_ms_per_summary", ">6.3f", 1),
        ("RSS MiB", "rss_mib", ">7.0f", 1),
        ("peak", "peak_rss_mib", ">6.0f", 1),
        ("det ms", "detect_ms", ">7.1f", 1),
        ("det max", "detect_ms_max", ">7.1f", 1),
        ("1 job", "detect_job_ms_max", ">6.1f", 1),
        ("GC ms", "gc_ms", ">6.0f", 1),
        ("full", "full_gc", ">4.1f", 1),
    ]
    print()
    print_table(rows, columns)
    print()
    print_table(rows, PAUSE_COLUMNS)
    for row in rows:
        emit_figures(row)
    print(
        "load, after: the 1-minute load average before and after the run; CPU%: the child's CPU with its "
        "parsing workers as a share of one core, mean over all windows / over the second half / worst window; "
        "loop%: the event loop's process alone (mean); ms/sum: CPU per summary answered (loop: the loop's "
        "process alone); unanswered: no answer within 60 s after the last send; snd%, snd ms: the sender "
        "processes' own CPU (share of one core, per summary; not in CPU%); det ms: the detector's CPU over "
        "all jobs in one pass (mean of the last 3, max), 1 job: the slowest single job; GC ms: the loop "
        "process's garbage collection per window (full: full collections per window)"
    )


if __name__ == "__main__":
    main()
