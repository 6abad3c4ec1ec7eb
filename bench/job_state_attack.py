"""The "20 large summaries" attack on the operator's per-job state (issue 19): 20 summaries of 4,096
ranks x 64 communicators each, sent with a 16-rank job's token, folded into its state as the collector
does. Prints the state's size (tracemalloc) and what was dropped.

    .venv/bin/python bench/job_state_attack.py"""

from __future__ import annotations

import time
import tracemalloc

from rankwatch.operator.diagnosis.ingest.job_state import JobStore, StateLimits
from rankwatch.protocol import CommWindow, Quantiles, RankWindow, WindowSummary

RANKS, COMMS, SUMMARIES = 4096, 64, 20


def main() -> None:
    comms = [CommWindow(f"{c:016x}", 0, 8, 1, 2, 1, 2, 0, None, {"AllReduce": 2}, 0,
                        Quantiles(2, 0.001, 0.001, 0.001, 0.001), None, None) for c in range(COMMS)]  # fmt: skip
    ranks = [RankWindow(r, 0, 1, "r.ring", True, 2, 0, 0, 0, 1, 0.1, comms) for r in range(RANKS)]
    tracemalloc.start()
    state = JobStore().get("team-a", "llama", StateLimits.for_job(world_size=16, replicas=2))
    started = time.perf_counter()
    for index in range(SUMMARIES):
        summary = WindowSummary(1, "team-a", "llama", f"pod-{index % 2}", "node", 0, 8, index + 1, index + 1,
                                index + 2, 0, ranks)  # fmt: skip
        state.add_summary(summary, now=float(index))
    seconds = time.perf_counter() - started
    current, peak = tracemalloc.get_traced_memory()
    print(f"{SUMMARIES} summaries x {RANKS} ranks x {COMMS} communicators into a 16-rank job's state: "
          f"{len(state.ranks)} ranks, {sum(len(r.comms) for r in state.ranks.values())} communicator states kept, "
          f"{state.dropped} entries dropped, state {current / 2**20:.1f} MiB (peak {peak / 2**20:.1f} MiB), "
          f"{seconds:.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
