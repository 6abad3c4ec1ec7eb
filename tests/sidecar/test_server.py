"""/dump and /evidence behind the job's token, /metrics and /healthz open; what they return matches the
rings and the files."""

from __future__ import annotations

import io
import os
import tarfile

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from rankwatch.analysis.load import load_path
from rankwatch.analysis.ring import Op, read_ring
from rankwatch.sidecar.dump import split_dump


async def test_dump_refuses_requests_without_the_token_metrics_are_open(trace_dir, make_sidecar, token):
    sidecar = await make_sidecar(trace_dir)
    base = f"http://127.0.0.1:{sidecar.port}"
    async with aiohttp.ClientSession() as session:
        for path in ("/healthz", "/metrics"):  # as a cluster-wide Prometheus scrapes them: no job token
            async with session.get(base + path) as response:
                assert response.status == 200, path
        for path in ("/dump", "/evidence", "/profile"):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {token}"}):
                async with session.get(base + path, headers=headers) as response:
                    assert response.status == 401, (path, headers)
                    assert response.headers["WWW-Authenticate"].startswith("Bearer")
        async with session.get(f"{base}/dump", headers={"Authorization": f"Bearer {token}"}) as response:
            assert response.status == 200


async def test_metrics_count_the_calls_and_waits_of_each_rank(trace_dir, make_sidecar, token):
    sidecar = await make_sidecar(trace_dir)
    sidecar.poll()
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session,
        session.get(f"http://127.0.0.1:{sidecar.port}/metrics") as response,
    ):
        text = await response.text()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    for path in trace_dir.glob("*.ring"):
        ring = read_ring(path)
        rank = str(ring.header.global_rank)
        allreduce = ring.records[ring.records["op"] == Op.ALLREDUCE]
        labels = (("op", "AllReduce"), ("rank", rank))
        assert samples[("rankwatch_collective_calls_total", labels)] == len(allreduce)
        assert samples[("rankwatch_collective_wait_seconds_count", labels)] == len(allreduce)
        waits = (allreduce["t_return_ns"] - allreduce["t_call_ns"]) / 1e9
        assert np.isclose(samples[("rankwatch_collective_wait_seconds_sum", labels)], waits.sum())
        under_1ms = samples[("rankwatch_collective_wait_seconds_bucket", (("le", "0.001"), *labels))]
        assert under_1ms == int((waits <= 0.001).sum())
        assert samples[("rankwatch_sidecar_records_read_total", (("rank", rank),))] == len(ring.records)
        assert ("rankwatch_sidecar_stall_seconds", (("rank", rank),)) in samples
        assert samples[("rankwatch_sidecar_ring_lag_records", (("rank", rank),))] == 0
    assert samples[("rankwatch_sidecar_rings", ())] == 4
    assert samples[("rankwatch_sidecar_summaries_dropped_total", ())] == 0
    ops = {dict(labels).get("op") for name, labels in samples if name == "rankwatch_collective_calls_total"}
    assert ops == {"AllReduce", "Send", "Recv"}, "bounded labels: the operations, not the communicators"


async def test_dump_returns_the_last_records_as_ring_files_or_json(tmp_path, trace_dir, make_sidecar, token):
    sidecar = await make_sidecar(trace_dir)
    sidecar.poll()  # rings are served while they are followed
    originals = {read_ring(p).header.global_rank: read_ring(p) for p in trace_dir.glob("*.ring")}
    base = f"http://127.0.0.1:{sidecar.port}/dump"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:
        async with session.get(base, params={"limit": "50"}) as response:
            assert response.status == 200 and response.content_type == "application/octet-stream"
            body = await response.read()
            ranges = response.headers["X-Rankwatch-Dump-Ranges"]
        async with session.get(base, params={"rank": "1", "since": "130"}) as response:
            since_body = await response.read()
        async with session.get(base, params={"rank": "2", "limit": "3"}, headers={"Accept": "application/json"}) as r:
            document = await r.json()
        for bad in ({"limit": "0"}, {"since": "-1"}, {"rank": "x"}):
            async with session.get(base, params=bad) as response:
                assert response.status == 400, bad

    images = split_dump(body)
    assert len(images) == 4 and len(ranges.split(",")) == 4
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    for number, image in enumerate(images):
        (dumps / f"dump-{number}.ring").write_bytes(image)
        dumped = read_ring(dumps / f"dump-{number}.ring")
        original = originals[dumped.header.global_rank]
        assert dumped.torn == 0 and len(dumped.records) == 50
        for name in ("seq", "op", "comm_id", "t_call_ns", "t_return_ns", "count"):
            assert np.array_equal(dumped.records[name], original.records[name][-50:]), name
        assert dumped.header.pid == original.header.pid and dumped.header.hostname == original.header.hostname
    trace = load_path(dumps)
    assert sorted(trace.ranks) == [0, 1, 2, 3], "`rankwatch analyze` reads dumps as it reads rings"

    [since_image] = split_dump(since_body)
    (dumps / "since.ring").write_bytes(since_image)
    assert len(read_ring(dumps / "since.ring").records) == len(originals[1].records) - 130

    [ring] = document["rings"]
    assert ring["global_rank"] == 2 and ring["next"] == len(originals[2].records)
    assert [r["index"] for r in ring["records"]] == [ring["next"] - 3, ring["next"] - 2, ring["next"] - 1]
    last = originals[2].records[-1]
    assert ring["records"][-1]["seq"] == int(last["seq"]) and ring["records"][-1]["op"] == "CommDestroy"
    assert ring["records"][-1]["comm_id"] == f"{int(last['comm_id']):016x}"


async def test_evidence_is_a_tar_of_the_megatrace_logs_flight_recorder_dumps_and_megascan_traces_only(
    tmp_path, trace_dir, make_sidecar, token
):
    (trace_dir / "megatrace").mkdir()
    (trace_dir / "megatrace" / "rank_3.log").write_text("[save_count 1] [1.000000001] [Rank 3] Fun AllReduce\n")
    (trace_dir / "megascan").mkdir()
    (trace_dir / "megascan" / "benchmark-data-0-pipeline-1-tensor-1.json").write_text("[]")
    (trace_dir / "megascan" / "loss.json").write_text("{}")
    (trace_dir / "flight_recorder_rank_3").write_bytes(b'{"version": "2.10", "entries": []}')
    (trace_dir / "notes.txt").write_text("not evidence")
    secret = tmp_path / "secret"
    secret.write_text("keep out")
    os.symlink(secret, trace_dir / "flight_recorder_rank_9")
    sidecar = await make_sidecar(trace_dir)
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"http://127.0.0.1:{sidecar.port}/evidence", headers={"Authorization": f"Bearer {token}"}
        ) as response,
    ):
        assert response.status == 200 and response.content_type == "application/x-tar"
        body = await response.read()
    with tarfile.open(fileobj=io.BytesIO(body)) as archive:
        names = archive.getnames()
        assert archive.extractfile("megatrace/rank_3.log").read().startswith(b"[save_count 1]")
    expected = ["flight_recorder_rank_3", "megascan/benchmark-data-0-pipeline-1-tensor-1.json", "megatrace/rank_3.log"]
    assert sorted(names) == expected, "no rings, no other file, no symlink"


async def test_profile_answers_for_each_rank_asked_and_is_rate_limited(trace_dir, make_sidecar, token):
    sidecar = await make_sidecar(trace_dir)
    sidecar.poll()
    base = f"http://127.0.0.1:{sidecar.port}/profile"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:
        for bad in ("ranks=", "ranks=a,b", "ranks=0&seconds=60"):
            async with session.get(f"{base}?{bad}") as response:
                assert response.status == 400, bad
                assert "expected" in await response.text(), bad
        async with session.get(f"{base}?ranks=0,99&seconds=1") as response:
            assert response.status == 200
            ranks = (await response.json())["ranks"]
        # the rings' writers were C processes that have ended: no Python to sample, said per rank
        assert ranks["99"] == {"samples": 0, "functions": {}, "problem": "no live ring of rank 99 in this pod",
                               "python": True}  # fmt: skip
        assert ranks["0"]["samples"] == 0 and ranks["0"]["problem"], ranks
        async with session.get(f"{base}?ranks=0&seconds=1") as response:
            assert response.status == 429
            assert "ask again in" in await response.text()
