"""Diagnoses across jobs: a few at a time, the most severe first, one per job."""

from __future__ import annotations

import asyncio

from rankwatch.model.finding import FindingKind
from rankwatch.operator.diagnosis.diagnose.slots import DiagnosisSlots


async def test_at_most_the_limit_run_and_the_queue_serves_hangs_before_stragglers():
    slots = DiagnosisSlots(2)
    running, peak, order = set(), 0, []
    release = asyncio.Event()

    def diagnosis(name: str):
        async def run() -> None:
            nonlocal peak
            running.add(name)
            peak = max(peak, len(running))
            order.append(name)
            await release.wait()
            running.discard(name)

        return run

    for index in range(6):
        kind = FindingKind.HANG if index == 4 else FindingKind.STRAGGLER
        slots.request(("ns", f"job-{index}"), kind.severity, diagnosis(f"job-{index}"))
    await asyncio.sleep(0.01)
    assert order == ["job-0", "job-1"] and len(slots.waiting) == 4
    slots.request(("ns", "job-5"), FindingKind.HANG.severity, diagnosis("job-5-hang"))  # raised in the queue
    slots.request(("ns", "job-0"), FindingKind.HANG.severity, diagnosis("again"))  # runs already: ignored
    release.set()
    while slots.running or slots.waiting:
        await asyncio.sleep(0.01)
    assert peak == 2
    assert order == ["job-0", "job-1", "job-4", "job-5-hang", "job-2", "job-3"]


async def test_a_failing_diagnosis_frees_its_slot_and_a_cancelled_job_leaves_the_queue():
    slots = DiagnosisSlots(1)
    ran = []

    async def fail() -> None:
        raise RuntimeError("sidecar said no")

    async def ok() -> None:
        ran.append("ok")

    slots.request(("ns", "a"), 1, fail)
    slots.request(("ns", "b"), 1, ok)
    slots.request(("ns", "c"), 1, ok)
    slots.cancel(("ns", "c"))
    while slots.running or slots.waiting:
        await asyncio.sleep(0.01)
    assert ran == ["ok"]
