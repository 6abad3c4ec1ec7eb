"""The ring names its GPU: the interposer reads the device of the process's first communicator
(ncclCommCuDevice) and its UUID from the driver (cuDeviceGet, cuDeviceGetUuid) into the header, and
`rankwatch analyze` names the GPU beside the rank and the node. Rings of the format before (version 1)
are still read, without a GPU. Real processes on the stand-in NCCL and CUDA (the stand-in's device is
the rank's LOCAL_RANK, its UUID fixed by node and ordinal, as a board's is)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from rankwatch.analysis.load import load_path
from rankwatch.analysis.ring import RingReader
from rankwatch.standins.ring_writer import write_rings
from rankwatch.standins.simulate import Faults, Simulation, run

UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def headers(directory) -> dict[int, object]:
    found = {}
    for path in directory.glob("*.ring"):
        with RingReader(path) as reader:
            header = reader.header()
        found[header.global_rank] = header
    return found


def test_each_ring_names_its_gpu_and_analyze_shows_it_beside_rank_and_node(tmp_path):
    run(Simulation(device="sync", gpu_timing=False, world_size=4, tp=2, steps=6, compute_us=300, ranks_per_node=2,
                   faults=Faults(hang_rank=3, hang_at=15)), tmp_path)  # fmt: skip
    rings = headers(tmp_path)
    assert sorted(rings) == [0, 1, 2, 3]
    assert all(header.version == 2 for header in rings.values())
    assert {rank: header.gpu_index for rank, header in rings.items()} == {0: 0, 1: 1, 2: 0, 3: 1}, "LOCAL_RANK"
    uuids = {rank: header.gpu_uuid for rank, header in rings.items()}
    assert all(UUID.match(uuid) for uuid in uuids.values()), uuids
    assert len(set(uuids.values())) == 4, "GPU 0 of sim-node-0 is not GPU 0 of sim-node-1"

    result = subprocess.run([sys.executable, "-m", "rankwatch", "analyze", str(tmp_path), "--json", "-"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    [hang] = json.loads(result.stdout)["findings"]
    assert hang["ranks"] == [3]
    assert hang["evidence"]["gpus"] == [{"rank": 3, "node": "sim-node-1", "index": 1, "uuid": uuids[3]}]
    assert f"  GPU: rank 3 on node sim-node-1: GPU 1 ({uuids[3]})" in result.stderr.splitlines()


def test_rings_of_the_format_before_are_read_without_a_gpu(tmp_path):
    run(Simulation(device="sync", gpu_timing=False, world_size=2, steps=3, compute_us=300), tmp_path / "new")
    trace = load_path(tmp_path / "new")
    write_rings(trace, tmp_path / "old")  # version 1, as rankwatch wrote them before the header named GPUs
    old = headers(tmp_path / "old")
    assert {header.version for header in old.values()} == {1}
    assert all(header.gpu_index is None and header.gpu_uuid is None for header in old.values())
    again = load_path(tmp_path / "old")
    assert len(again.calls) == len(trace.calls) and all(s.gpu_index is None for s in again.ranks.values())
