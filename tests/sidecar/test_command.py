"""`rankwatch sidecar` as the pod runs it: configured by the operator's injected environment, it
flushes the last window on SIGTERM and exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import aiohttp

from rankwatch.operator.config import WorkerPodSettings
from rankwatch.operator.lifecycle import pod_spec
from rankwatch.operator.spec import TrainingJobSpec


def injected_env(collector_url: str) -> dict[str, str]:
    """The sidecar container's environment exactly as the operator builds it (field refs resolved)."""
    job = {"metadata": {"name": "llama", "namespace": "team-a", "uid": "uid-1"}}
    spec = TrainingJobSpec(template={"spec": {"containers": [{"name": "trainer", "image": "t"}]}}, nprocPerNode=4)
    pod = pod_spec.worker_pod(job, spec, 0, WorkerPodSettings(collector_url=collector_url))
    sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == pod_spec.SIDECAR_CONTAINER)
    assert sidecar["command"] == ["rankwatch", "sidecar"]
    fields = {"metadata.name": "llama-worker-0", "spec.nodeName": "gpu-node-3", "status.podIP": "127.0.0.1"}
    return {
        item["name"]: item["value"] if "value" in item else fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        for item in sidecar["env"]
    }


async def test_sidecar_command_flushes_the_last_window_on_sigterm(
    tmp_path, trace_dir, token_file, token, collector, free_port, ring_calls, summarised_calls
):
    env = injected_env(collector.url)
    assert env["RANKWATCH_TRACE_DIR"] == pod_spec.TRACE_DIR
    env.update(  # the paths the pod mounts, here on the local disk
        RANKWATCH_TRACE_DIR=str(trace_dir), RANKWATCH_TOKEN_FILE=str(token_file), RANKWATCH_WINDOW_SECONDS="3600"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "rankwatch", "sidecar", "--port", str(free_port), "--host", "127.0.0.1"],
        env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:
            for _ in range(200):
                try:
                    async with session.get(f"http://127.0.0.1:{free_port}/metrics") as response:
                        if "rankwatch_sidecar_records_read_total" in await response.text():
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the sidecar never served its metrics")
        assert collector.summaries == [], "an hour-long window: nothing sent before the shutdown"
        process.send_signal(signal.SIGTERM)
        output, _ = await asyncio.to_thread(process.communicate, timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    [summary] = collector.summaries
    assert (summary.namespace, summary.job, summary.pod, summary.node) == (
        "team-a",
        "llama",
        "llama-worker-0",
        "gpu-node-3",
    )
    assert summary.expected_ranks == 4 and summary.window == 1
    assert summarised_calls([summary]) == ring_calls(trace_dir), "the flushed window holds every call"
