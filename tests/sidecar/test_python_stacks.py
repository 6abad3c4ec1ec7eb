"""Python stacks on a stall: py-spy reads the rank processes' stacks, the stall report carries them, and
the diagnosis says where the culprit is against its peers. Real Python processes, real py-spy."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from rankwatch.model.finding import Finding
from rankwatch.operator.diagnosis.diagnose.python_frames import latest_stacks, with_python_stacks
from rankwatch.operator.diagnosis.ingest.job_state import JobState
from rankwatch.sidecar.python_stacks import py_spy, runs_python, take_stack

pytestmark = pytest.mark.skipif(py_spy() is None, reason="py-spy is not installed (pip install py-spy)")

# A rank stopped in its data loader, and a peer waiting inside a collective.
RANK_CODE = (
    "import sys, time\n"
    "def load_batch():\n"
    "    print('ready', flush=True)\n"
    "    time.sleep(3600)\n"
    "def all_reduce():\n"
    "    print('ready', flush=True)\n"
    "    time.sleep(3600)\n"
    "def train_step():\n"
    "    load_batch() if sys.argv[1] == 'culprit' else all_reduce()\n"
    "train_step()\n"
)


@pytest.fixture
def rank_process() -> Iterator[Callable[[str], subprocess.Popen]]:
    started: list[subprocess.Popen] = []

    def start(role: str) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", RANK_CODE, role], stdout=subprocess.PIPE, text=True)
        assert process.stdout.readline().strip() == "ready"
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
        process.wait()


def test_the_stack_of_a_python_process_names_its_innermost_function(rank_process):
    result = take_stack(rank_process("culprit").pid)
    assert result.problem is None and result.frames
    assert result.frames[0].endswith(" load_batch") and result.frames[1].endswith(" train_step")
    not_python = subprocess.Popen(["sleep", "30"])
    try:
        assert runs_python(rank_process("peer").pid) and not runs_python(not_python.pid), (
            "the stall watch asks only Python"
        )
        result = take_stack(not_python.pid)
        assert result.frames is None, "a C process has no Python stack"
        assert result.problem and "python" in result.problem.lower(), f"said, not raised: {result.problem!r}"
    finally:
        not_python.kill()
        not_python.wait()


async def test_a_stall_report_carries_the_ranks_python_stacks_and_the_diagnosis_shows_them(
    tmp_path, collector, make_sidecar, ring_writer, rank_process
):
    traces = tmp_path / "traces"
    traces.mkdir()
    peer, culprit = rank_process("peer"), rank_process("culprit")
    writers = {0: ring_writer(traces / f"rankwatch-n-{peer.pid}.ring", 0, peer.pid),
               1: ring_writer(traces / f"rankwatch-n-{culprit.pid}.ring", 1, culprit.pid)}  # fmt: skip
    for _ in range(3):
        for writer in writers.values():
            writer.call()
    writers[0].call(finish=False)  # the peer enters the collective the culprit never calls
    sidecar = await make_sidecar(traces, collector.url, window_s=1.0, poll_s=0.1, sensitivity_s=1.0)
    stop = asyncio.Event()
    running = asyncio.create_task(sidecar.run(stop))
    started = time.monotonic()
    await collector.wait_for(lambda: bool(collector.stalls), timeout=15)
    stop.set()
    await running
    _, report = collector.stalls[0]
    stacks = {position.global_rank: position.python_stack for position in report.positions}
    assert stacks[1] and stacks[1][0].endswith(" load_batch"), stacks
    assert stacks[0] and stacks[0][0].endswith(" all_reduce"), stacks
    print(f"stall report with stacks {time.monotonic() - started:.1f} s after the sidecar started")

    state = JobState("team-a", "llama")
    state.add_stall(report)
    hang = Finding("hang", [1], ["sim-node-0"], None, 0.9, "rank 1 never called AllReduce 4")
    shown = with_python_stacks(hang, latest_stacks(state, since=0))
    assert "Python: rank 1 is at " in shown.summary and shown.summary.split("rank 1 is at ")[1].startswith("<string>")
    assert " load_batch; rank 0 at <string>:" in shown.summary and shown.summary.endswith(" all_reduce")
    assert shown.evidence["python_stacks"]["1"][0].endswith(" load_batch")
    assert shown.cause == "data/storage" and "rank 1 is in <string>:" in shown.cause_evidence
    assert with_python_stacks(hang, latest_stacks(state, since=time.monotonic() + 1)) == hang, "stale stacks"
