"""Why, end to end: the diagnosis on the job says the cause, with the figures that decided it. Real
operator, sidecars reading /proc, pod runner and stand-in NCCL; the faults are real: a rank computing
30% slower, and a rank whose CPU is shared with busy neighbour processes."""

from __future__ import annotations

import re
import sys
import time

import pytest
from trainingjobs import (
    STRAGGLER,
    create_job,
    diagnosed,
    events,
    get_job,
    report,
    standin_job,
    stored_diagnosis,
    wait_running,
)

pytestmark = pytest.mark.e2e


def diagnosis_with_cause(api, kubectl, namespace: str, name: str, eventually) -> tuple[dict, str]:
    """(status.diagnosis once the job is Degraded, the Warning Event's message)."""
    job = eventually(lambda: diagnosed(api, namespace, name, "Degraded"), 150, interval=1, what="Degraded=True")
    diagnosis = stored_diagnosis(job)
    warning = eventually(
        lambda: [e.message for e in events(api, namespace, name) if e.reason == diagnosis["kind"]],
        20,
        what="the diagnosis Event",
    )[0]
    finding = report(api, namespace, job)["findings"][0]
    assert (finding["cause"], finding["cause_evidence"]) == (diagnosis["cause"], diagnosis["causeEvidence"])
    described = kubectl("describe", "tj", name, "-n", namespace).stdout
    assert re.search(rf"\bCause:\s+{re.escape(diagnosis['cause'])}\n", described), described
    return diagnosis, warning


def test_a_straggler_from_slower_compute_has_cause_compute(api, kubectl, namespace, pod_runner, eventually):
    faults = STRAGGLER
    create_job(api, namespace, standin_job("slow-compute", faults))
    wait_running(api, namespace, "slow-compute", eventually)
    diagnosis, warning = diagnosis_with_cause(api, kubectl, namespace, "slow-compute", eventually)
    assert diagnosis["kind"] == "Straggler" and diagnosis["ranks"] == [5]
    assert diagnosis["cause"] == "compute", diagnosis
    evidence = diagnosis["causeEvidence"]
    assert re.search(r"its time between collectives is [\d.]+ ms longer than its peers'", evidence), evidence
    # on the asynchronous device the GPU times decide it (its collectives waited on its GPU behind earlier
    # work: the GPU, not the host, is behind); on the synchronous one the hosts' CPU figures do
    host_figures = re.search(r"rank 5 waited \d+ ms/s for a CPU, like its 7 peers \(\d+ ms/s\)", evidence)
    assert host_figures or "the GPU, not the host, is behind" in evidence, evidence
    assert "cause compute: its time between collectives" in warning
    print(f"slower compute: {diagnosis['summary']}; cause {diagnosis['cause']}: {evidence}", file=sys.__stdout__)


def test_a_rank_starved_of_cpu_by_busy_neighbours_has_cause_host(api, kubectl, namespace, pod_runner, eventually):
    # eleven busy processes share rank 5's CPU (pinned with it, same priority): a dataloader with too many
    # workers, another tenant's processes on the same core. On the asynchronous device (the default) with GPU
    # timing on (the CRD's default). The driver's host spends real CPU time per launch and per step, as a
    # PyTorch host does (`simulate-pod --host-us-per-launch 20 --host-us-per-step 500`: 20 us a launch of a
    # 500 us kernel, 0.5 ms a step; the driver's default is none): on a whole CPU it keeps ahead of its
    # GPU; on a twelfth of one it cannot, its GPU idles, its collectives start last and its TP peers wait
    # for it (2026-11-26: named
    # 6 s after Running, its peers waiting 1.3-1.7 ms per collective against its 0.34-0.36 ms; step 44 ms
    # against 29 ms healthy in runs by hand). With three neighbours (and a heavier host cost, 20 us per
    # 200 us kernel, 1 ms a step) it was named as quickly, but its host slept in its synchronisations much
    # of the time: its run-queue delay was 1.6x its peers' (136 vs 85 ms/s; the rule wants 3x) and the
    # cause came out `compute`. This test has no GPU-timing-off variant; there the expected answer is
    # "not localisable": in a run by hand (11 neighbours, RANKWATCH_GPU_TIMING=0) every rank's host wait in
    # its TP collectives was p50 0-1 us (the call returns at once) and `rankwatch analyze` said "a slowdown
    # is not localisable from call times; enable GPU timing" and named nobody.
    faults = {"RANKWATCH_STANDIN_FAULT_RANK": "5", "RANKWATCH_STANDIN_CPU_NEIGHBOURS": "11"}
    host_cost = ("--host-us-per-launch", "20", "--host-us-per-step", "500")
    create_job(api, namespace, standin_job("starved", faults, driver_args=host_cost))
    started = wait_running(api, namespace, "starved", eventually)
    diagnosis, warning = diagnosis_with_cause(api, kubectl, namespace, "starved", eventually)
    latency = time.monotonic() - started
    assert diagnosis["kind"] == "Straggler" and diagnosis["ranks"] == [5], diagnosis
    assert diagnosis["cause"] == "host", diagnosis
    evidence = diagnosis["causeEvidence"]
    found = re.search(r"rank 5's process waited (\d+) ms per second for a CPU .* against a median (\d+) ms/s", evidence)
    assert found, evidence
    starved_ms, peers_ms = int(found[1]), int(found[2])
    assert starved_ms >= 50 and starved_ms >= 3 * peers_ms
    assert "cause host: rank 5's process waited" in warning
    job = get_job(api, namespace, "starved")
    assert job["status"]["suspects"] == diagnosis["nodes"][0]
    print(f"starved host diagnosed {latency:.0f} s after Running: {diagnosis['summary']}; "
          f"cause {diagnosis['cause']}: {evidence}", file=sys.__stdout__)  # fmt: skip


def test_a_rank_stalled_in_python_is_shown_at_its_frame_against_its_peers(api, namespace, pod_runner, eventually):
    # a Python training loop (the stand-in NCCL through ctypes, as PyTorch reaches NCCL); rank 2's data
    # loader never returns the batch of step 300, so its peers wait in the all-reduce it never calls
    faults = {"RANKWATCH_STANDIN_FAULT_RANK": "2", "RANKWATCH_STANDIN_DATA_STALL_AT_STEP": "300"}
    manifest = standin_job("data-stall", faults)
    manifest["spec"]["template"]["spec"]["containers"][0]["command"] = [
        "rankwatch", "simulate-pod", "--python", "--steps", "1000000",
    ]  # fmt: skip
    create_job(api, namespace, manifest)
    wait_running(api, namespace, "data-stall", eventually)
    job = eventually(lambda: diagnosed(api, namespace, "data-stall", "Hung"), 90, interval=1, what="Hung=True")
    diagnosis = stored_diagnosis(job)
    assert diagnosis["kind"] == "Hang" and diagnosis["ranks"] == [2], diagnosis
    summary = diagnosis["summary"]
    found = re.search(r"Python: rank 2 is at \S+python_rank\.py:\d+ load_batch; ranks ([\d, ]+) at \S+ (\S+)", summary)
    assert found, summary
    assert found[2] == "Nccl.all_reduce" and {0, 1, 3} <= {int(rank) for rank in found[1].split(", ")}, summary
    stacks = report(api, namespace, job)["findings"][0]["evidence"]["python_stacks"]
    assert stacks["2"][0].endswith(" load_batch") and stacks["2"][1].endswith(" train")
    assert diagnosis["cause"] == "data/storage" and "load_batch" in diagnosis["causeEvidence"], diagnosis
    print(f"stalled in Python: {summary}", file=sys.__stdout__)


def test_a_python_straggler_is_shown_slower_in_its_slow_function_against_two_peers(
    api, kubectl, namespace, pod_runner, eventually
):
    # a Python training loop whose rank 5 runs backward 60% slower (a slower kernel in one layer): the
    # diagnosis samples it and two peers with py-spy and names backward, with the shares
    faults = {"RANKWATCH_STANDIN_FAULT_RANK": "5", "RANKWATCH_STANDIN_BACKWARD_SLOWDOWN": "0.6"}
    manifest = standin_job("slow-backward", faults, gpu_timing=True)
    manifest["spec"]["parallelism"] = {"tensor": 1, "pipeline": 1}  # its one communicator: data parallel, 8 ranks
    manifest["spec"]["template"]["spec"]["containers"][0]["command"] = [
        "rankwatch", "simulate-pod", "--python", "--steps", "1000000",
    ]  # fmt: skip
    create_job(api, namespace, manifest)
    started = wait_running(api, namespace, "slow-backward", eventually)
    diagnosis, warning = diagnosis_with_cause(api, kubectl, namespace, "slow-backward", eventually)
    assert diagnosis["kind"] == "Straggler" and diagnosis["ranks"] == [5], diagnosis
    summary = diagnosis["summary"]
    # the functions whose share differs most, largest first: backward (its extra time) and the all-reduce
    # (where its peers wait for it) differ by about as much, so either may come first
    found = re.search(
        r"Python profile \(3 s, sampled with its peers\): rank 5 spends .* for ranks (\d+), (\d+)", summary
    )
    assert found, summary
    assert {int(found[1]), int(found[2])} <= {4, 6, 7}, summary  # its own pod's ranks
    backward = re.search(r"(\d+)% (?:of its time )?in backward \(\S+\) against (\d+)%", summary)
    assert backward and int(backward[1]) >= int(backward[2]) + 5, summary
    profile = report(api, namespace, get_job(api, namespace, "slow-backward"))["findings"][0]["evidence"][
        "python_profile"
    ]
    assert profile["culprit"] == 5 and all(samples >= 50 for samples in profile["samples"].values()), profile
    assert {d["function"].split(" ")[0] for d in profile["differences"][:2]} == {"backward", "Nccl.all_reduce"}, profile
    assert found[0] in warning  # the Event says it too
    assert diagnosis["cause"] == "compute", diagnosis  # slower between its collectives, its host not starved
    print(
        f"Python straggler diagnosed {time.monotonic() - started:.0f} s after Running: {summary}", file=sys.__stdout__
    )
