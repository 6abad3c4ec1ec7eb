"""`rankwatch analyze`: load a trace, run the detectors, print a summary and write the JSON report."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from rankwatch.analysis.cause import attribute
from rankwatch.analysis.chrome_trace import chrome_trace
from rankwatch.analysis.completeness import GivenLayout, coverage, resolve_layout
from rankwatch.analysis.compute_gaps import detect_compute_stragglers
from rankwatch.analysis.compute_spans import detect_iteration_slowdown, detect_span_stragglers
from rankwatch.analysis.devices import add_gpus, gpu_text
from rankwatch.analysis.fail_slow import detect_fail_slow
from rankwatch.analysis.findings import AnalysisReport, Finding, ranked, utc_text
from rankwatch.analysis.hang import detect_hangs, short_ends
from rankwatch.analysis.heap import keep_freed_memory
from rankwatch.analysis.host_compute import detect_host_stragglers
from rankwatch.analysis.host_link import detect_host_links
from rankwatch.analysis.html_report import html_report
from rankwatch.analysis.late_windows import windowed_stragglers
from rankwatch.analysis.load import load_path
from rankwatch.analysis.mismatch import detect_mismatches
from rankwatch.analysis.slow_link import detect_slow_links
from rankwatch.analysis.stacks import add_frames
from rankwatch.analysis.straggler import detect_stragglers
from rankwatch.analysis.trace import Trace, is_collective

TEST_TYPES = ("all", "hang", "slow", "parallel")
# Ranks are compared over at most this many of the most recent calls; None: every call (32 M calls of a
# 16k-rank job fit the analysis' 4 GiB). Hangs and the step-time history always use everything.
EVIDENCE_CALLS: int | None = None


def recent_since(trace: Trace, budget: int | None = EVIDENCE_CALLS) -> int | None:
    """The call time after which about ``budget`` calls lie, or None when the trace is smaller (or no budget)."""
    calls = len(trace.calls)
    if budget is None or calls <= budget:
        return None
    sample = trace.calls["t_call"][:: max(1, calls // 200_000)]
    return int(np.quantile(sample, 1 - budget / calls))


RUN_AHEAD_WAIT_NS = 20_000
NOT_LOCALISABLE = (
    "every call returned at once and no GPU times were recorded (the GPU runs behind the host): a slowdown "
    "is not localisable from call times; enable GPU timing (spec.tracing.gpuTiming, RANKWATCH_GPU_TIMING=1)"
)


def returned_at_once(trace: Trace) -> bool:
    """Host call times only, and the collectives' calls returned in a median under 20 µs: an asynchronous
    GPU's host enqueues and goes on, so who arrives last on the GPU is not in these times."""
    calls = trace.calls
    if not len(calls) or (calls["gpu_start"] > 0).any():
        return False
    collective = is_collective(calls["op"]) & (calls["t_return"] > 0)
    if collective.sum() < 8:
        return False
    return _median_below(calls["t_return"][collective] - calls["t_call"][collective], RUN_AHEAD_WAIT_NS)


def _median_below(values: np.ndarray, threshold: int) -> bool:
    """``np.median(values) < threshold`` for integers, by counting: no partition of millions of values."""
    n, below = len(values), int(np.count_nonzero(values < threshold))
    if n % 2 or below != n // 2:  # the middle value(s) on one side of the threshold
        return below > n // 2
    middle = np.array([values[values < threshold].max(), values[values >= threshold].min()])
    return float(np.mean(middle)) < threshold  # the two middle values straddle it: their mean decides


def host_call_times_only(trace: Trace) -> bool:
    """Call times of a backend whose calls block their host (gloo on CPU) and nothing else: each call
    time is when the rank's compute ended, not a host running ahead of a GPU."""
    return trace.calls_block_on_host and not trace.has_returns and not (trace.calls["gpu_start"] > 0).any()


def analyze(trace: Trace, test_type: str = "all", stall_seconds: float = 1.0) -> dict[str, Any]:
    """:func:`analyze_trace` as the ``--json`` document."""
    return analyze_trace(trace, test_type, stall_seconds).to_json()


def analyze_trace(
    trace: Trace, test_type: str = "all", stall_seconds: float = 1.0, now_ns: int | None = None
) -> AnalysisReport:
    """Findings of the chosen detectors (Megatrace's test types: ``hang``; ``slow``, the job against
    its own history and the ranks behind it; ``parallel``, ranks against their peers); a hung job is
    not also scored for slowness, unless the hang comes from call times alone. ``now_ns``: the wall
    clock the calls still pending are judged at (default now; a live job's dumps: when they were asked for)."""
    if test_type not in TEST_TYPES:
        raise ValueError(f"--test-type must be one of {', '.join(TEST_TYPES)}, got {test_type!r}")
    findings: list[Finding] = []
    problems = list(trace.problems)
    if test_type in ("all", "hang"):
        mismatches = detect_mismatches(trace)
        hangs = detect_hangs(trace, stall_seconds, now_ns)
        if mismatches and hangs:  # the peers of a mismatched call wait for a call that never comes
            problems.append(
                "the hang follows from the mismatched collective(s): the ranks it would name wait for a call their "
                "peers made differently, not reported as a hang"
            )
            hangs = []
        findings += mismatches + hangs
        if not hangs and not trace.has_returns and not trace.pending_known:  # logs that end: say so
            problems += short_ends(trace, stall_seconds, now_ns)
    # a hang found from call times alone (Megatrace: no completion recorded) is where the logs end, and
    # says nothing of the lateness before it: those are scored too
    weak_hang = not trace.has_returns and not trace.pending_known
    arrivals = trace  # what the straggler analysis compares: arrival_times, when it runs
    if test_type in ("slow", "parallel") or (test_type == "all" and (not findings or weak_hang)):
        arrivals = arrival_times(trace)
        links: list[Finding] = []
        since = recent_since(trace)
        if since is not None:
            problems.append(f"{len(trace.calls):,} calls: ranks compared over the most recent {EVIDENCE_CALLS or 0:,}")
        if trace.has_returns:
            links = detect_slow_links(trace, since_ns=since)
        else:
            if host_call_times_only(trace):  # gloo: a late receive holds its receiver before its next collective
                links = detect_host_links(trace, problems)
            else:
                problems.append("these logs carry only call times: slow links need return times (rankwatch rings)")
            if trace.ranks_per_node is None and all(source.node == "unknown" for source in trace.ranks.values()):
                problems.append("host clocks taken as aligned across nodes; --ranks-per-node lets rankwatch remove "
                                "each node's clock offset")  # fmt: skip
        if arrivals is not trace:
            problems.append(NOT_LOCALISABLE)
        endpoints = frozenset(rank for link in links for rank in link.ranks)
        if host_call_times_only(trace):  # gloo: call times are when compute ended; the job's own spread decides
            stragglers = detect_host_stragglers(trace, problems, since_ns=since, explained=endpoints)
        else:
            stragglers = detect_stragglers(arrivals, explained_by_links=endpoints, since_ns=since, problems=problems)
        if not stragglers:  # waits name nobody (TP=1, or a small slowdown): the GPUs' compute per step
            stragglers = detect_compute_stragglers(trace, explained=endpoints)
        if not stragglers and trace.spans is not None:  # MegaScan: each microbatch's compute, recorded
            stragglers, notes = detect_span_stragglers(trace, explained=endpoints)
            problems += notes
        findings += links + stragglers
        if test_type != "parallel":
            slower = fail_slow_with_culprits(trace, arrivals, endpoints)
            if not slower and trace.iterations is not None:  # MegaScan: the iterations' own times
                slower, notes = detect_iteration_slowdown(trace)
                problems += notes
            findings += slower if not host_call_times_only(trace) else _host_bound_rise(slower, problems)
    findings = windowed_stragglers(arrivals, findings, problems)
    add_frames(trace, findings)
    add_gpus(trace, findings)
    # the traces alone decide the causes they can (slow link, a GPU behind); the in-cluster diagnosis
    # decides again with the hosts' scheduling figures
    return ranked([attribute(finding) for finding in findings], problems)


def arrival_times(trace: Trace) -> Trace:
    """The trace whose waits the straggler analysis compares: when every call returned at once without
    GPU times (a host running ahead of its GPU), what is inside a call is microseconds of host
    scheduling, not waiting for a peer, so only when each rank arrived tells anything: the trace seen
    as call times alone (as Megatrace's logs are), whose lateness run-ahead must not explain."""
    return replace(trace, has_returns=False) if trace.has_returns and returned_at_once(trace) else trace


def fail_slow_with_culprits(trace: Trace, arrivals: Trace, explained: frozenset[int]) -> list[Finding]:
    """A step-time rise, with the stragglers of the steps after its onset as the ranks behind it
    (``arrivals``: :func:`arrival_times` of the trace)."""

    def stragglers_after(onset_ns: int) -> list[int]:
        if host_call_times_only(trace):
            since = max(onset_ns, recent_since(trace) or 0)
            later = detect_host_stragglers(trace, [], since, explained=explained)
            return sorted({rank for finding in later for rank in finding.ranks})
        since = max(onset_ns, recent_since(trace) or 0)
        later = detect_stragglers(arrivals, explained_by_links=explained, since_ns=since)
        # call times alone name a rank only where run-ahead cannot explain its lateness (as for stragglers)
        later = windowed_stragglers(arrivals, later, [])
        return sorted({rank for finding in later for rank in finding.ranks})

    return detect_fail_slow(trace, stragglers_after)


def _host_bound_rise(slower: list[Finding], problems: list[str]) -> list[Finding]:
    """A step-time rise of a job whose compute runs on its hosts' CPUs (gloo), with no rank behind it:
    every rank slowed together, as the machine's load does; told, not reported as the job's fault."""
    for finding in slower:
        if not finding.ranks:
            problems.append(
                f"{finding.summary}: every rank slowed together, on a backend that computes on the hosts' CPUs (their "
                "load does this): a slowdown is not localisable"
            )
    return [finding for finding in slower if finding.ranks]


def summary_text(report: AnalysisReport, trace: Trace) -> str:
    lines = [f"{len(trace.ranks)} ranks, {len(trace.calls)} NCCL calls, {len(trace.comms)} communicators"]
    if len(trace.calls):
        lines[0] += f", {utc_text(int(trace.calls['t_call'].min()))} to {utc_text(trace.end_ns)}"
    for problem in report.problems:
        lines.append(f"warning: {problem}")
    if report.inconclusive:
        lines.append(f"INCONCLUSIVE: {report.inconclusive}")
    elif report.healthy:
        lines.append("healthy: no hang, no straggler, no slow link, no fail-slow")
    for finding in report.findings:
        lines.append(f"{finding.kind.value.upper()} (confidence {finding.confidence:.2f}): {finding.summary}")
        lines.append(f"  {finding.cause_text}")
        for gpu in finding.evidence.get("gpus", ()):
            lines.append(f"  GPU: {gpu_text(gpu)}")
        for key, who in (("culprit_frame", "its call"), ("waiting_frame", "its peers wait")):
            if frame := finding.evidence.get(key):
                lines.append(f"  {who} at {frame['file']}:{frame['line']} in {frame['function']}")
    return "\n".join(lines)


STANDARD_OUTPUT = "-"
INCONCLUSIVE_EXIT, UNREADABLE_EXIT = 1, 2
"""Exit codes: 0 a verdict (healthy or findings) on the whole input; 1 inconclusive, part of it read (the
report says what is missing); 2 nothing to analyse, or arguments the traces contradict."""


def main(
    path: str,
    test_type: str,
    stall_seconds: float,
    json_out: str | None,
    layout: GivenLayout | None = None,
    ranks_per_node: int | None = None,
    chrome_out: str | None = None,
    html_out: str | None = None,
    workers: int = 1,
    skipped: tuple[str, ...] = (),
    seen_until_ns: int | None = None,
) -> int:
    """``rankwatch analyze``: the text summary on standard output (on standard error when an output is
    ``-``, standard output), the reports to their files. ``skipped``: inputs left unread before
    ``path`` (an archive's files that are not regular files inside it), counted as the trace's own.
    ``seen_until_ns``: when the job was last seen still running (its user says so): logs that end
    before it by the stall threshold end in a stall, not merely where they were cut."""
    outputs = [out for out in (json_out, chrome_out, html_out) if out]
    if outputs.count(STANDARD_OUTPUT) > 1:
        print(
            "rankwatch analyze: only one of --json, --chrome-trace, --html can be - (standard output)", file=sys.stderr
        )
        return UNREADABLE_EXIT
    summary_to = sys.stderr if STANDARD_OUTPUT in outputs else sys.stdout
    keep_freed_memory()  # this process analyses once and exits
    try:
        trace = load_path(path, workers, layout.layout if layout else None)
        trace.skipped += skipped
        if seen_until_ns is not None and trace.observed_until_ns is not None:
            trace.observed_until_ns = max(trace.observed_until_ns, seen_until_ns)
        directory = Path(path) if Path(path).is_dir() else None
        resolved, world_size = resolve_layout(trace, directory, layout)
        trace.layout = resolved or trace.layout  # MegaScan's file names give the layout
        trace.ranks_per_node = ranks_per_node
        covered = coverage(trace, world_size)
        if covered.nothing_read:
            print(f"rankwatch analyze: inconclusive: {covered.reason()}", file=sys.stderr)
            if json_out:
                nothing = AnalysisReport([], trace.problems, covered.reason()).to_json()
                _write(json_out, json.dumps({**nothing, "coverage": covered.to_json()}, indent=2))
            return UNREADABLE_EXIT
        result = analyze_trace(trace, test_type, stall_seconds)
    except (FileNotFoundError, ValueError) as error:
        print(f"rankwatch analyze: {error}", file=sys.stderr)
        return UNREADABLE_EXIT
    result = replace(result, inconclusive=covered.reason())
    print(summary_text(result, trace), file=summary_to)
    document = {**result.to_json(), "coverage": covered.to_json()}
    if json_out:
        _write(json_out, json.dumps(document, indent=2))
    if chrome_out:
        _write(chrome_out, json.dumps(chrome_trace(trace, document["findings"])))
    if html_out:
        _write(html_out, html_report(trace, document))
    if result.inconclusive:
        print(f"rankwatch analyze: inconclusive: {result.inconclusive}", file=sys.stderr)
        return INCONCLUSIVE_EXIT
    return 0


def _write(out: str, text: str) -> None:
    """A report to its file, or to standard output for ``-``."""
    if out == STANDARD_OUTPUT:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    else:
        Path(out).write_text(text)
