"""Chrome trace / Perfetto JSON: one process per rank, NCCL calls as slices, findings as markers.

Open the file at ui.perfetto.dev or chrome://tracing. A call still pending at the end of the trace
is drawn up to the end and marked ``pending``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from rankwatch.analysis.findings import comm_label
from rankwatch.analysis.ring import Op
from rankwatch.analysis.trace import Trace


def chrome_trace(trace: Trace, findings: list[dict[str, Any]]) -> dict[str, Any]:
    calls = trace.calls
    origin = int(calls["t_call"].min()) if len(calls) else 0
    end = trace.end_ns
    events: list[dict[str, Any]] = []
    for rank in sorted(trace.ranks):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": trace.label(rank)}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
    returned = calls["t_return"] > 0
    finish = np.where(returned, calls["t_return"], end)
    names = {int(op): Op(int(op)).name.title() for op in np.unique(calls["op"])}
    for row, stop, done in zip(calls.tolist(), finish.tolist(), returned.tolist(), strict=True):
        rank, comm, seq, op, count = row[0], row[1], row[2], row[3], row[4]
        events.append(
            {
                "ph": "X",
                "pid": rank,
                "tid": comm_label(comm),
                "name": f"{names[op]} #{seq}",
                "ts": (row[9] - origin) / 1e3,
                "dur": max(stop - row[9], 0) / 1e3,
                "args": {"communicator": comm_label(comm), "count": count, "pending": not done},
            }
        )
    for finding in findings:
        for rank in finding["ranks"]:
            events.append(
                {
                    "ph": "i",
                    "s": "p",
                    "pid": rank,
                    "name": f"{finding['kind'].upper()}: {finding['summary'][:200]}",
                    "ts": (end - origin) / 1e3,
                    "args": {
                        "confidence": finding["confidence"],
                        "cause": finding.get("cause", "unknown"),
                        "cause_evidence": finding.get("cause_evidence", ""),
                        **finding["evidence"],
                    },
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(trace: Trace, findings: list[dict[str, Any]], path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(trace, findings)))
