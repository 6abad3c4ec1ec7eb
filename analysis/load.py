"""Which reader a path is for: rings, Megatrace logs, flight-recorder dumps or MegaScan traces, all read
into one ``Trace`` (readers import the trace model; this module imports the readers)."""

from __future__ import annotations

import re
from pathlib import Path

from rankwatch.analysis.flight_recorder import read_dumps
from rankwatch.analysis.megascan import megascan_files, read_traces
from rankwatch.analysis.megatrace import log_files, read_logs
from rankwatch.analysis.ring_loader import load_rings
from rankwatch.analysis.topology import Layout
from rankwatch.analysis.trace import Trace


def load_path(path: str | Path, workers: int = 1, layout: Layout | None = None) -> Trace:
    """A directory of rings (e.g. a trace directory or a `rankwatch simulate --out`), of Megatrace
    logs (rank_<R>.log), of PyTorch flight-recorder dumps (<prefix>rank_<R>) or of MegaScan traces
    (benchmark-data-<dp>-pipeline-<pp>-tensor-<tp>.json, or their aggregated file); one ring file or
    one MegaScan file.
    ``workers``: processes reading rings in parallel (forked: only from a single-threaded program).
    ``layout``: the job's Megatron layout, which readers use where their source leaves groups unnamed;
    the trace carries it unless its source named one itself (MegaScan's file names)."""
    trace = _read(Path(path), workers, layout)
    if layout is not None and trace.layout is None:
        trace.layout = layout
    return trace


def _read(path: Path, workers: int, layout: Layout | None) -> Trace:
    if path.is_dir():
        rings = sorted(path.glob("*.ring"), key=str)  # as strings: comparing 16k paths part by part costs seconds
        if rings:
            return load_rings(rings, workers)
        if log_files(path):
            return read_logs(path, layout)
        dumps = [p for p in path.iterdir() if p.is_file() and re.search(r"rank_\d+(\.\w+)?$", p.name)]
        if dumps:
            return read_dumps(dumps, layout)
        if megascan_files(path):
            return read_traces(path, layout)
        raise FileNotFoundError(
            f"{path}: no *.ring files, Megatrace rank_<R>.log files, flight-recorder *rank_<R> dumps or "
            "MegaScan benchmark-*.json traces"
        )
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.suffix == ".json":
        return read_traces(path, layout)
    return load_rings([path])
