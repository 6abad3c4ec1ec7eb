"""Interposer overhead per NCCL call, GPU timing off and on, on the synchronous and the asynchronous
stand-in device (libcuda.so.1, RANKWATCH_STANDIN_DEVICE). Prints a table.

"direct" calls the stand-in's pncclAllReduce, "traced" goes through the interposer; "added" is the
difference, the interposer's own cost. On the asynchronous device a call only launches the operation
(and, with GPU timing, two event records) onto the stream; its launch queue is made deep enough here
that the host never waits for the executor, so the figures are launch costs, not collective times.
The last column counts malloc/calloc/realloc and pthread_mutex_lock calls made by anything in the
process during the timed calls: the interposer's hot path makes none; on the asynchronous device the
stand-in device and NCCL lock their launch queue and copy each operation (as a real driver does work
per launch).

.venv/bin/python bench/interposer_overhead.py
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from figures import Figure, emit

from rankwatch.standins.native import native_artifacts

HERE = Path(__file__).parent


def main() -> None:
    artifacts = native_artifacts()
    with tempfile.TemporaryDirectory() as scratch:
        binary = Path(scratch) / "interposer_overhead"
        subprocess.run(
            ["gcc", "-O2", "-o", str(binary), str(HERE / "interposer_overhead.c"), f"-L{artifacts.standin_dir}",
             "-l:libnccl.so.2", f"-Wl,-rpath,{artifacts.standin_dir}"],
            check=True,
        )  # fmt: skip
        columns = ("direct p50", "traced p50", "added p50", "added p99", "ratio p50", "allocs/locks")
        print(f"{'device':<7} {'GPU timing':<11} " + " ".join(f"{column:>11}" for column in columns))
        for device, gpu in (("sync", "0"), ("sync", "1"), ("async", "0"), ("async", "1")):
            env = {
                **os.environ,
                "LD_PRELOAD": str(artifacts.interposer),
                "LD_LIBRARY_PATH": str(artifacts.standin_dir),
                "RANKWATCH_TRACE_DIR": scratch,
                "RANKWATCH_GPU_TIMING": gpu,
                "RANKWATCH_STANDIN_DEVICE": device,
                "RANKWATCH_STANDIN_LAUNCH_QUEUE": "65536",
                "RANKWATCH_STANDIN_SESSION": f"bench-{os.getpid()}",
            }
            out = subprocess.run([str(binary)], env=env, capture_output=True, text=True, check=True).stdout
            r = json.loads(out)
            ratio = r["traced_p50_ns"] / r["direct_p50_ns"]
            print(
                f"{device:<7} {'on' if gpu == '1' else 'off':<11} "
                f"{r['direct_p50_ns']:>9.0f}ns {r['traced_p50_ns']:>9.0f}ns "
                f"{r['added_p50_ns']:>9.0f}ns {r['added_p99_ns']:>9.0f}ns {ratio:>10.2f}x "
                f"{r['allocations']:>6}/{r['mutex_locks']}"
            )
            name = f"interposer.traced_p50.{device}.gpu_timing_{'on' if gpu == '1' else 'off'}"
            emit(Figure(name, r["traced_p50_ns"], "ns", r["direct_p50_ns"], "the same call without the interposer"))
            for ring in Path(scratch).glob("*.ring"):
                ring.unlink()


if __name__ == "__main__":
    main()
