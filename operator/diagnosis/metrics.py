"""The operator's own Prometheus metrics (served at /metrics on the collector's port).

Labels are bounded: message kinds, results and finding kinds, never job or rank names. The per-job
series (phase, health, conditions, detections, step and wait times) are computed at scrape time by
``job_metrics.JobMetrics`` and go with the job.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

COLLECTOR_MESSAGES = Counter(
    "rankwatch_collector_messages_total",
    "Sidecar messages received by the collector, by kind (summary, stall) and result (accepted, duplicate, "
    "unauthorized, unknown_job, too_large, invalid, rate_limited, error)",
    ["kind", "result"],
)
COLLECTOR_RANK_WINDOWS = Counter(
    "rankwatch_collector_rank_windows_total", "Per-rank windows taken from accepted summaries"
)
COLLECTOR_DROPPED = Counter(
    "rankwatch_collector_dropped_total",
    "Entries the collector did not keep because a job's state was full (what: rank, pod, comm, ended_pod); "
    "non-zero means a job sends more than its spec allows (or someone holding its token does)",
    ["what"],
)
SUSPICIONS = Counter(
    "rankwatch_detector_suspicions_total",
    "Suspicions raised by the detector, by the kind of finding suspected (hang, straggler, fail_slow)",
    ["kind"],
)
DETECTOR_SECONDS = Histogram(
    "rankwatch_detector_duration_seconds",
    "One run of the detector over one job's state (once per job per window, on the collector's event loop: "
    "summaries wait while it runs)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
DIAGNOSES = Counter(
    "rankwatch_diagnoses_total",
    "Diagnosis runs by outcome (finding, no_finding, failed, out_of_memory, timeout, crashed)",
    ["outcome"],
)
DIAGNOSES_RUNNING = Gauge("rankwatch_diagnoses_running", "Diagnoses running now (at most the configured concurrency)")
DIAGNOSES_WAITING = Gauge("rankwatch_diagnoses_waiting", "Diagnoses queued for a free slot")
DIAGNOSIS_PEAK_BYTES = Histogram(
    "rankwatch_diagnosis_worker_peak_bytes",
    "Peak resident memory of a diagnosis's analysis worker",
    buckets=tuple(float(mib << 20) for mib in (32, 64, 128, 256, 384, 512, 768, 1024, 2048)),
)
DIAGNOSIS_SECONDS = Histogram(
    "rankwatch_diagnosis_duration_seconds",
    "From suspicion to the diagnosis written on the job (dumps fetched, analysis, writes)",
    buckets=(0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120),
)
RECOVERIES = Counter("rankwatch_recoveries_total", "Findings cleared because the job recovered", ["kind"])


def diagnoses_in_progress(running: int, waiting: int) -> None:
    DIAGNOSES_RUNNING.set(running)
    DIAGNOSES_WAITING.set(waiting)
