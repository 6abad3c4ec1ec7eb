"""The diagnosis's analysis in a worker process: real dumps of a simulated job in, a typed report out;
an analysis beyond its memory budget or its time is stopped and reported, never the operator's problem."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from rankwatch.model.finding import FindingKind
from rankwatch.operator.diagnosis.diagnose.worker import AnalysisRequest, WorkerFailed, analyse, render_evidence
from rankwatch.sidecar.dump import ring_image, select
from rankwatch.sidecar.ring_tail import RingTail
from rankwatch.standins.simulate import Faults, Simulation, run

TP, WORLD = 4, 8


@pytest.fixture(scope="module")
def straggler_rings(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """A simulated 8-rank job (TP 4) whose rank 5 computes twice as long: its rings (9,000 calls each), by rank.
    400 us of compute per step: 50 us was within what a loaded machine's scheduling adds to a step."""
    out = tmp_path_factory.mktemp("straggler")
    run(Simulation(world_size=WORLD, tp=TP, steps=1000, compute_us=400, ranks_per_node=4,
                   faults=Faults(slow_rank=5, slowdown=1.0)), out, log=lambda *_: None)  # fmt: skip
    meta = json.loads((out / "simulation.json").read_text())
    return {entry["rank"]: Path(entry["ring"]) for entry in meta["ranks"]}


def write_dump(path: Path, rings: list[Path], repeat: int = 1) -> None:
    """What a sidecar's /dump answers for these rings (``repeat``: each ring's records that many times over)."""
    with path.open("wb") as out:
        for ring in rings:
            tail = RingTail(ring)
            records, _ = select(tail, 0, 1 << 30)
            out.write(ring_image(tail, np.tile(records, repeat)))


def request() -> AnalysisRequest:
    return AnalysisRequest(TP, 1, WORLD, {rank: f"gpu-node-{rank // 4}" for rank in range(WORLD)}, 1.0)


def test_the_worker_names_the_straggler_from_the_pods_dumps(straggler_rings, tmp_path):
    write_dump(tmp_path / "job-worker-0.dump", [straggler_rings[r] for r in range(4)])
    write_dump(tmp_path / "job-worker-1.dump", [straggler_rings[r] for r in range(4, 8)])
    (tmp_path / "job-worker-2.dump").write_bytes(b"<html>502 Bad Gateway</html>")
    budget = 512 << 20
    result = asyncio.run(analyse(tmp_path, request(), budget, 120))
    # on a loaded machine the whole job may drift too: a job-wide finding names no rank and is no blame
    [finding] = [finding for finding in result.report.findings if finding.ranks]
    # the node its pod is bound to (the request's), not the one its rings claim (sim-node-1): a rank's own
    # process writes that, and may name another team's node
    assert finding.kind is FindingKind.STRAGGLER and finding.ranks == [5] and finding.nodes == ["gpu-node-1"]
    assert any("job-worker-2" in problem and "ring header" in problem for problem in result.report.problems)
    # the analysis's own peak (about 75 MiB here), not the forking process's
    assert "STRAGGLER" in result.text and 0 < result.peak_rss_bytes < 256 << 20
    assert not list(tmp_path.glob("*.dump")), "the dumps are cut into rings and gone"


def test_an_analysis_beyond_its_memory_budget_is_stopped_and_reported(straggler_rings, tmp_path):
    write_dump(tmp_path / "job-worker-0.dump", list(straggler_rings.values()), repeat=12)  # 128 MiB
    with pytest.raises(WorkerFailed, match=r"needed more than its memory budget of 160 MiB") as caught:
        asyncio.run(analyse(tmp_path, request(), 160 << 20, 120))
    assert caught.value.reason == "out_of_memory"


def test_an_analysis_beyond_its_time_is_killed(straggler_rings, tmp_path):
    write_dump(tmp_path / "job-worker-0.dump", list(straggler_rings.values()))
    with pytest.raises(WorkerFailed, match=r"took longer than 0 s and was stopped") as caught:
        asyncio.run(analyse(tmp_path, request(), 1 << 30, 0.05))  # the analysis alone takes ~0.4 s
    assert caught.value.reason == "timeout"


def dumped_at(path: Path, rings: list[Path], at_ns: int) -> None:
    """What a sidecar's /dump would have answered at ``at_ns`` of the run: the calls made by then, those
    not yet returned in flight."""
    from rankwatch.analysis.ring import State

    with path.open("wb") as out:
        for ring in rings:
            tail = RingTail(ring)
            records, _ = select(tail, 0, 1 << 30)
            records = records[records["t_call_ns"] <= at_ns].copy()
            in_flight = records["t_return_ns"] > at_ns
            records["t_return_ns"][in_flight], records["state"][in_flight] = 0, State.ENTERED
            out.write(ring_image(tail, records))


def test_a_live_jobs_dumps_are_judged_when_they_were_asked_for_not_when_analysed(straggler_rings, tmp_path):
    """Dumps of a running job always hold collectives in flight, and a pod's dump taken a moment before
    its peer's lacks the call the peer just entered; judged seconds later (a busy machine) they looked
    like a hang naming healthy ranks (without ``asked_at_ns``: ranks 0-3, "rank 6 waits in Allreduce
    #1502 ... which rank 0 never entered")."""
    calls = [select(RingTail(path), 0, 1 << 30)[0] for path in straggler_rings.values()]
    middle = int(np.median(np.concatenate([c["t_call_ns"] for c in calls])))
    dumped_at(tmp_path / "job-worker-0.dump", [straggler_rings[r] for r in range(4)], middle)
    dumped_at(tmp_path / "job-worker-1.dump", [straggler_rings[r] for r in range(4, 8)], middle + 3_000_000)
    asked = dataclasses.replace(request(), asked_at_ns=middle - 1_000_000)
    result = asyncio.run(analyse(tmp_path, asked, 512 << 20, 120))
    assert not [f for f in result.report.findings if f.kind is FindingKind.HANG], result.text
    # the straggler still, and nobody else (a loaded machine may add a job slowdown behind the same rank)
    assert [f.ranks for f in result.report.findings if f.kind is FindingKind.STRAGGLER] == [[5]], result.text
    assert {rank for f in result.report.findings for rank in f.ranks} == {5}, result.text


def test_an_archive_is_cut_and_rendered_in_the_worker_not_in_the_operator(straggler_rings, tmp_path):
    rings = tmp_path / "rings"
    rings.mkdir()
    write_dump(rings / "job-worker-0.dump", [straggler_rings[r] for r in range(4)])
    write_dump(rings / "job-worker-1.dump", [straggler_rings[r] for r in range(4, 8)])
    (rings / "job-worker-2.dump").write_bytes(b"<html>502 Bad Gateway</html>")
    bound = {"job-worker-0": "gpu-node-0", "job-worker-1": "gpu-node-1"}  # the rings claim sim-node-0 and -1
    result = asyncio.run(render_evidence(tmp_path, (TP, 1, WORLD), 512 << 20, 120, bound))
    assert sorted(path.name for path in rings.iterdir()) == [
        f"job-worker-{p}-{i}.ring" for p in (0, 1) for i in range(4)
    ]
    assert (tmp_path / "report.html").read_text().lower().startswith("<!doctype html>")
    assert json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    assert any(finding["ranks"] == [5] and finding["nodes"] == ["gpu-node-1"] for finding in result.findings)
    assert "sim-node" not in (tmp_path / "analysis.txt").read_text(), "each rank on its pod's node"
    assert any("job-worker-2" in problem for problem in result.problems)
    assert 0 < result.peak_rss_bytes < 512 << 20


def test_an_archive_beyond_the_workers_memory_is_reported_not_rendered(straggler_rings, tmp_path):
    rings = tmp_path / "rings"
    rings.mkdir()
    write_dump(rings / "job-worker-0.dump", [straggler_rings[r] for r in range(4)], repeat=8)
    with pytest.raises(WorkerFailed) as failed:
        asyncio.run(render_evidence(tmp_path, (TP, 1, WORLD), 160 << 20, 120))
    assert failed.value.reason in ("out_of_memory", "crashed") and "rendering" in str(failed.value)
    assert not (tmp_path / "report.html").exists()
