"""The analysis of one diagnosis, in a process of its own, within a memory budget.

Why a process: a diagnosis may hold hundreds of MiB of records and minutes of numpy work; in the
operator's process it would share the memory limit (and the GIL) with the collector, the event
loop and every other diagnosis, and one oversized dump would get the whole operator OOM-killed
exactly when many jobs need it. The worker limits its own address space to its budget
(``RLIMIT_AS``, set before numpy is imported; address space is never below the resident set), so
an analysis that needs more fails with ``MemoryError`` and exits with :data:`OUT_OF_MEMORY`; it
also volunteers as the kernel's first choice under memory pressure (``oom_score_adj``). The parent
kills it after the timeout. The untrusted bytes of the sidecars' dumps are parsed here too.

Protocol (files in the diagnosis directory): ``*.dump`` (each pod's ``/dump`` response as
received), ``request.json`` (layout, node of each rank, stall seconds) in; ``result.json``
(the report as the ``--json`` document, its text, peak RSS) out.

An archive's evidence is rendered here too (``--render``, :func:`render_evidence`): its dumps cut into
rings and analysed into ``report.html`` and ``timeline.json`` within the same limits, so an archive's
size costs the operator's process nothing. In: the evidence directory and ``render.json`` (layout);
out: ``rendered.json`` (findings, problems, peak RSS).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import mmap
import os
import resource
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rankwatch.analysis.findings import AnalysisReport

if TYPE_CHECKING:
    from rankwatch.analysis.topology import Layout
    from rankwatch.analysis.trace import RankSource, Trace

OUT_OF_MEMORY = 3
BAD_INPUT = 4
WORKER_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
"""One BLAS thread and two malloc arenas: each extra thread reserves address space the budget would pay for."""


class WorkerFailed(RuntimeError):
    """The analysis did not finish; the message says why (memory, time, crash) in words for the log."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason  # out_of_memory | timeout | crashed


@dataclass(frozen=True)
class AnalysisRequest:
    tp: int | None
    pp: int | None
    world_size: int | None
    node_of_rank: dict[int, str]
    stall_seconds: float
    asked_at_ns: int | None = None
    """Wall clock when the dumps were asked for: a call pending in them is judged at that moment, not when
    the analysis runs (on a busy machine seconds later, when every collective in flight at the dump, and
    a peer's dump taken a moment earlier without it, would look like a hang)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "layout": None if self.tp is None else [self.tp, self.pp, self.world_size],
            "node_of_rank": {str(rank): node for rank, node in self.node_of_rank.items()},
            "stall_seconds": self.stall_seconds,
            "asked_at_ns": self.asked_at_ns,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AnalysisRequest:
        tp, pp, world = data["layout"] or (None, None, None)
        nodes = {int(rank): str(node) for rank, node in data["node_of_rank"].items()}
        asked = data.get("asked_at_ns")
        return cls(tp, pp, world, nodes, float(data["stall_seconds"]), None if asked is None else int(asked))


@dataclass(frozen=True)
class AnalysisResult:
    report: AnalysisReport
    text: str
    peak_rss_bytes: int
    peak_address_space_bytes: int
    seconds: float


async def analyse(directory: Path, request: AnalysisRequest, memory_bytes: int, timeout_s: float) -> AnalysisResult:
    """Run the worker on ``directory``; raises :class:`WorkerFailed` when it runs out of memory or
    time, or crashes (it is killed then: nothing of it outlives the call)."""
    (directory / "request.json").write_text(json.dumps(request.to_json()))
    started = time.monotonic()
    await _run_worker([str(directory), str(memory_bytes)], memory_bytes, timeout_s, "analysis")
    result = json.loads((directory / "result.json").read_text())
    return AnalysisResult(
        AnalysisReport.from_json(result["report"]), result["text"], int(result["peak_rss_bytes"]),
        int(result["peak_address_space_bytes"]), time.monotonic() - started,
    )  # fmt: skip


@dataclass(frozen=True)
class RenderResult:
    findings: list[dict[str, Any]]
    problems: list[str]
    peak_rss_bytes: int


async def render_evidence(
    directory: Path,
    layout: tuple[int, int, int] | None,
    memory_bytes: int,
    timeout_s: float,
    pod_nodes: Mapping[str, str] | None = None,
) -> RenderResult:
    """Cut the archive's dumps (``directory/rings/<pod>.dump``) into rings and render its reports in the
    worker, each rank on its pod's node in ``pod_nodes``; raises :class:`WorkerFailed` as :func:`analyse`
    does (the rings cut so far stay)."""
    (directory / "render.json").write_text(json.dumps({"layout": layout, "pod_nodes": dict(pod_nodes or {})}))
    try:
        await _run_worker(["--render", str(directory), str(memory_bytes)], memory_bytes, timeout_s, "rendering")
        result = json.loads((directory / "rendered.json").read_text())
    finally:
        (directory / "render.json").unlink(missing_ok=True)
    (directory / "rendered.json").unlink(missing_ok=True)
    return RenderResult(result["findings"], result["problems"], int(result["peak_rss_bytes"]))


async def _run_worker(args: list[str], memory_bytes: int, timeout_s: float, what: str) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        __name__,
        *args,
        env={**os.environ, **WORKER_ENV},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, stderr = await asyncio.wait_for(process.communicate(), timeout_s)
    except (TimeoutError, asyncio.CancelledError) as error:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        if isinstance(error, asyncio.CancelledError):
            raise
        raise WorkerFailed(f"the {what} took longer than {timeout_s:.0f} s and was stopped", "timeout") from None
    budget = f"{memory_bytes >> 20} MiB"
    if process.returncode == OUT_OF_MEMORY:
        raise WorkerFailed(f"the {what} needed more than its memory budget of {budget}", "out_of_memory")
    if process.returncode and process.returncode < 0:
        raise WorkerFailed(
            f"the {what} was killed by signal {-process.returncode} (budget {budget}; an OOM kill shows as 9)",
            "crashed",
        )
    if process.returncode:
        tail = stderr.decode(errors="replace").strip().splitlines()[-5:]
        raise WorkerFailed(f"the {what} failed (exit {process.returncode}): {' | '.join(tail)}", "crashed")


def split_dumps(directory: Path) -> list[str]:
    """Cut each ``*.dump`` into its ring images (``<pod>-<n>.ring``), mapped rather than read into
    memory; a body that is not a dump is a problem named in the report, the other pods still count."""
    from rankwatch.protocol import ProtocolError
    from rankwatch.sidecar.dump import split_dump

    problems = []
    for dump in sorted(directory.glob("*.dump")):
        with dump.open("rb") as handle, contextlib.ExitStack() as stack:
            if os.fstat(handle.fileno()).st_size:
                mapped = stack.enter_context(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))
                view = stack.enter_context(memoryview(mapped))
                try:
                    _write_rings(directory, dump.stem, split_dump(view))
                except ProtocolError as error:
                    problems.append(f"pod {dump.stem}: {error}")
        dump.unlink()
    return problems


def _write_rings(directory: Path, pod: str, images: list[memoryview]) -> None:
    """(Its own frame, so that no slice of the mapping outlives it and the mapping can close.)"""
    for index, image in enumerate(images):
        (directory / f"{pod}-{index}.ring").write_bytes(image)


def run(directory: Path) -> dict[str, Any]:
    """The analysis itself (in the worker): the report document, its text, the peak RSS."""
    from rankwatch.analysis.analyze import analyze_trace, summary_text
    from rankwatch.analysis.load import load_path
    from rankwatch.analysis.topology import Layout, LayoutError

    request = AnalysisRequest.from_json(json.loads((directory / "request.json").read_text()))
    problems = split_dumps(directory)
    if not any(directory.glob("*.ring")):
        report = AnalysisReport([], [*problems, "no ring in the dumps"])
        return {"report": report.to_json(), "text": "\n".join(report.problems), "peak_rss_bytes": _peak_rss(),
                "peak_address_space_bytes": _peak_address_space()}  # fmt: skip
    trace = load_path(directory)
    layout = None
    if request.tp is not None and (not trace.ranks or max(trace.ranks) < (request.world_size or 0)):
        with contextlib.suppress(LayoutError):
            layout = Layout(request.tp, request.pp or 1, request.world_size or 0)
    trace.layout = layout
    bind_nodes(trace, lambda rank, _: request.node_of_rank.get(rank))
    found = analyze_trace(trace, "all", request.stall_seconds, request.asked_at_ns)
    report = AnalysisReport(found.findings, problems + found.problems)
    return {
        "report": report.to_json(),
        "text": summary_text(report, trace),
        "peak_rss_bytes": _peak_rss(),
        "peak_address_space_bytes": _peak_address_space(),
    }


def bind_nodes(trace: Trace, node_of: Callable[[int, RankSource], str | None]) -> None:
    """Each rank on the node the operator knows for it (where the pod its job controls is bound), over the
    node its ring claims: the rank's own process writes that (it may set RANKWATCH_NODE_NAME as it likes)
    and so may name another team's node."""
    for rank, source in list(trace.ranks.items()):
        node = node_of(rank, source)
        if node and node != source.node:
            trace.ranks[rank] = dataclasses.replace(source, node=node)


def render(directory: Path, memory_bytes: int) -> dict[str, Any]:
    """An archive's rendering itself (in the worker): rings from its dumps, report.html, timeline.json.

    The rendering grows with the rings it reads (see :data:`RING_SHARE_OF_RENDER_MEMORY`): rings beyond
    the worker's share are analysed by their newest calls only, and the report says so; the archive
    keeps them whole for ``rankwatch analyze``."""
    from rankwatch.analysis.topology import Layout, LayoutError

    request = json.loads((directory / "render.json").read_text())
    layout = None
    if request.get("layout"):
        with contextlib.suppress(LayoutError, TypeError, ValueError):
            layout = Layout(*(int(value) for value in request["layout"]))
    rings = directory / "rings"
    problems = split_dumps(rings) if rings.is_dir() else []
    findings: list[dict[str, Any]] = []
    share = int(memory_bytes * RING_SHARE_OF_RENDER_MEMORY)
    ring_paths = sorted(rings.glob("*.ring")) if rings.is_dir() else []
    total = sum(path.stat().st_size for path in ring_paths)
    analysed = rings
    try:
        if total > share:
            analysed = directory.parent / f".{directory.name}-analysed-rings"
            calls = _newest_calls(ring_paths, analysed, max(MIN_ANALYSED_CALLS, share // 128 // len(ring_paths)))
            problems.append(
                f"report.html analyses the newest {calls} calls of each rank: the rings' {total >> 20} MiB are more "
                f"than the rendering's {share >> 20} MiB (rankwatch analyze on the archive reads them all)"
            )
        pod_nodes = request.get("pod_nodes") or {}
        findings = render_reports(directory, layout, analysed, problems, pod_nodes)
    except ValueError as error:  # an unreadable ring: the rings are kept, the analysis is not
        problems.append(f"the archived rings could not be analysed: {error}")
    finally:
        if analysed != rings:
            for path in analysed.glob("*.ring"):
                path.unlink()
            with contextlib.suppress(OSError):
                analysed.rmdir()
    return {"findings": findings, "problems": problems, "peak_rss_bytes": _peak_rss()}


ARCHIVE_STALL_SECONDS = 1.0


def render_reports(
    directory: Path, layout: Layout | None, rings: Path, problems: list[str], pod_nodes: Mapping[str, str] | None = None
) -> list[dict[str, Any]]:
    """Analyse the archived ``rings`` (``<pod>-<n>.ring``) and write report.html, timeline.json and
    analysis.txt into ``directory``; the findings (as ``--json`` writes them)."""
    from rankwatch.analysis.analyze import analyze_trace, summary_text
    from rankwatch.analysis.chrome_trace import write_chrome_trace
    from rankwatch.analysis.html_report import write_html_report
    from rankwatch.analysis.load import load_path

    if not any(rings.glob("*.ring")):
        problems.append("no ring was archived: no report.html or timeline.json")
        return []
    trace = load_path(rings)
    nodes = pod_nodes or {}
    bind_nodes(trace, lambda _, source: nodes.get(Path(source.path).stem.rsplit("-", 1)[0]))
    if layout is not None and (not trace.ranks or max(trace.ranks) < layout.world_size):
        trace.layout = layout
    report = analyze_trace(trace, "all", ARCHIVE_STALL_SECONDS)
    document = report.to_json()
    write_html_report(trace, document, str(directory / "report.html"))
    write_chrome_trace(trace, document["findings"], str(directory / "timeline.json"))
    (directory / "analysis.txt").write_text(summary_text(report, trace) + "\n")
    return document["findings"]


MIN_ANALYSED_CALLS = 500
RING_SHARE_OF_RENDER_MEMORY = 1 / 16
"""Ring bytes per byte of the worker's memory when rendering an archive. The HTML report and the
timeline hold far more per call than the diagnosis' analysis (``DUMP_SHARE_OF_WORKER_MEMORY``): 32 MiB
of rings needed more than 256 MiB and rendered within 1 GiB (bench/evidence_memory.py)."""


def _newest_calls(rings: list[Path], directory: Path, calls: int) -> int:
    """Copies of ``rings`` holding their newest ``calls`` records each, in ``directory``."""
    from rankwatch.sidecar.dump import ring_image, select
    from rankwatch.sidecar.ring_tail import RingTail

    directory.mkdir(exist_ok=True)
    for ring in rings:
        tail = RingTail(ring)
        try:
            (directory / ring.name).write_bytes(ring_image(tail, select(tail, 0, calls)[0]))
        finally:
            tail.close()
    return calls


def _peak_rss() -> int:
    """VmHWM, the peak of this process image only: ``ru_maxrss`` keeps the forking operator's RSS
    across the exec, so it would report the operator's size rather than the analysis's."""
    return _status_kib("VmHWM") * 1024


def _peak_address_space() -> int:
    """VmPeak: what the budget (``RLIMIT_AS``) is measured against."""
    return _status_kib("VmPeak") * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def main(argv: list[str]) -> int:
    rendering = argv[0] == "--render"
    if rendering:
        argv = argv[1:]
    directory, memory_bytes = Path(argv[0]), int(argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    with contextlib.suppress(OSError):  # raising one's own OOM score needs no privilege
        Path("/proc/self/oom_score_adj").write_text("1000")
    try:
        result = render(directory, memory_bytes) if rendering else run(directory)
    except MemoryError:
        return OUT_OF_MEMORY
    except OSError as error:  # a mapping beyond the limit fails with ENOMEM, not MemoryError
        if error.errno == errno.ENOMEM:
            return OUT_OF_MEMORY
        raise
    (directory / ("rendered.json" if rendering else "result.json")).write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
