"""The one place a new diagnosis is handed to remediation (cordon / taint, issue 6 item 4).

Remediation lives in ``rankwatch.operator.remediation``, built separately. Its entry point is

    remediate(job: dict, diagnosis: rankwatch.operator.diagnosis.Diagnosis) -> Any   (sync or async)

``job`` is the TrainingJob as just read from the API server (metadata, spec, status before the
diagnosis was written); ``diagnosis`` carries kind, ranks, nodes, pods, confidence, summary, time and
the analysis finding. It is called once per new diagnosis (not again for the same culprit after an
operator restart: the job's status says it was reported), from the operator's event loop; a sync
entry point runs in a worker thread. Until that module exists this is a no-op; its errors are
logged and never stop the diagnosis from being written or alerted.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
from typing import Any

from rankwatch.operator.diagnosis import Diagnosis

log = logging.getLogger(__name__)

MODULE = "rankwatch.operator.remediation"
ENTRY_POINT = "remediate"


def _entry_point() -> Any:
    try:
        module = importlib.import_module(MODULE)
    except ModuleNotFoundError as error:
        if error.name != MODULE:
            raise
        return None
    return getattr(module, ENTRY_POINT, None)


async def remediate(job: dict[str, Any], diagnosis: Diagnosis) -> None:
    entry = _entry_point()
    if entry is None:
        return
    name = f"{job['metadata']['namespace']}/{job['metadata']['name']}"
    try:
        if inspect.iscoroutinefunction(entry):
            await entry(job, diagnosis)
        else:
            await asyncio.to_thread(entry, job, diagnosis)
    except Exception:
        log.exception("remediation of TrainingJob %s (%s on %s) failed", name, diagnosis.kind, diagnosis.nodes)
