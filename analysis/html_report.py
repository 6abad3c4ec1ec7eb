"""A self-contained HTML report: the findings with their evidence, the step-time series and a
per-rank wait-time heatmap over time (inline SVG, no scripts, no external files)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import numpy as np

from rankwatch.analysis.fail_slow import step_times
from rankwatch.analysis.findings import Finding
from rankwatch.analysis.trace import Trace, is_collective

BINS = 80
MAX_ROWS = 512


def _heatmap(trace: Trace) -> str:
    calls = trace.calls[is_collective(trace.calls["op"]) & (trace.calls["t_return"] > 0)]
    if not len(calls):
        return "<p>No completed collectives to draw.</p>"
    ranks = np.unique(calls["rank"])[:MAX_ROWS]
    calls = calls[np.isin(calls["rank"], ranks)]
    # In floating point: a trace's times are its own say (a ring may hold any 64-bit value), and
    # integer differences of far-apart times overflow.
    called = calls["t_call"].astype(np.float64)
    start, end = float(called.min()), float(called.max())
    span = end - start or 1.0
    column = np.clip(((called - start) / span * BINS).astype(np.int64), 0, BINS - 1)
    row = np.searchsorted(ranks, calls["rank"])
    total = np.zeros((len(ranks), BINS))
    count = np.zeros((len(ranks), BINS))
    np.add.at(total, (row, column), (calls["t_return"].astype(np.float64) - called) / 1e6)
    np.add.at(count, (row, column), 1)
    mean = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
    top = float(np.percentile(mean[count > 0], 95)) or 1.0
    cell_w, cell_h = 8, max(3, min(14, 420 // len(ranks)))
    rects = []
    for r, c in zip(*np.nonzero(count), strict=True):
        level = min(1.0, mean[r, c] / top)
        colour = f"rgb(255,{int(255 * (1 - level))},{int(255 * (1 - level))})"
        rects.append(
            f'<rect x="{60 + c * cell_w}" y="{r * cell_h}" width="{cell_w}" height="{cell_h}" fill="{colour}">'
            f"<title>rank {ranks[r]}: mean wait {mean[r, c]:.3f} ms</title></rect>"
        )
    labels = "".join(
        f'<text x="55" y="{r * cell_h + cell_h}" font-size="{min(cell_h, 10)}" text-anchor="end">{rank}</text>'
        for r, rank in enumerate(ranks)
        if cell_h >= 8 or r % max(1, 8 // cell_h) == 0
    )
    height = len(ranks) * cell_h
    return (
        f'<svg width="{60 + BINS * cell_w}" height="{height + 20}" role="img" aria-label="wait-time heatmap">'
        f"{labels}{''.join(rects)}"
        f'<text x="60" y="{height + 15}" font-size="11">time → ({span / 1e9:.1f} s); white = no wait, '
        f"red = {top:.2f} ms or more (95th percentile)</text></svg>"
    )


def _step_plot(trace: Trace, findings: list[dict[str, Any]]) -> str:
    series = step_times(trace)
    if series is None:
        return "<p>No periodic step pattern found.</p>"
    _, durations, _ = series
    values = durations / 1e6
    width, height = 640, 200
    top = float(values.max()) * 1.1 or 1.0
    points = " ".join(
        f"{40 + i * (width - 50) / max(1, len(values) - 1):.1f},{height - 20 - v / top * (height - 40):.1f}"
        for i, v in enumerate(values)
    )
    marks = ""
    for finding in findings:
        if finding["kind"] == "fail_slow":
            step = finding["evidence"]["onset_step"] - 1
            x = 40 + step * (width - 50) / max(1, len(values) - 1)
            marks += (
                f'<line x1="{x:.1f}" y1="10" x2="{x:.1f}" y2="{height - 20}" stroke="red" stroke-dasharray="4"/>'
                f'<text x="{x + 4:.1f}" y="20" font-size="11" fill="red">onset</text>'
            )
    return (
        f'<svg width="{width}" height="{height}" role="img" aria-label="step time">'
        f'<polyline fill="none" stroke="steelblue" stroke-width="2" points="{points}"/>{marks}'
        f'<text x="40" y="{height - 4}" font-size="11">step 1 … {len(values)}; top of the plot = {top:.1f} ms</text>'
        f"</svg>"
    )


def html_report(trace: Trace, document: dict[str, Any]) -> str:
    findings = document["findings"]
    items = "".join(
        f"<li><b>{html.escape(f['kind'].upper())}</b> (confidence {f['confidence']:.2f}): {html.escape(f['summary'])}"
        f"<p>{html.escape(Finding.from_json(f).cause_text)}</p>"
        f"<pre>{html.escape(json.dumps(f['evidence'], indent=1))}</pre></li>"
        for f in findings
    )
    problems = "".join(f"<li>{html.escape(p)}</li>" for p in document["problems"])
    verdict = "healthy: no finding" if document["healthy"] else f"{len(findings)} finding(s), most likely first"
    if document.get("inconclusive"):
        verdict = f"INCONCLUSIVE: {document.get('inconclusive_reason', '')}; {verdict}"
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>rankwatch report</title>"
        "<style>body{font-family:sans-serif;margin:2em;max-width:1100px}pre{background:#f4f4f4;padding:.5em}"
        "</style></head><body>"
        f"<h1>rankwatch report</h1><p>{len(trace.ranks)} ranks, {len(trace.calls)} NCCL calls, "
        f"{len(trace.comms)} communicators — {html.escape(verdict)}</p>"
        f"<h2>Findings</h2><ol>{items or '<li>none</li>'}</ol>"
        + (f"<h2>Problems reading the input</h2><ul>{problems}</ul>" if problems else "")
        + f"<h2>Step time</h2>{_step_plot(trace, findings)}"
        f"<h2>Wait time per rank over time</h2>{_heatmap(trace)}"
        "</body></html>"
    )


def write_html_report(trace: Trace, document: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(html_report(trace, document))
