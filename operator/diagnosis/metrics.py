"""The operator's own Prometheus metrics of the collector, detector and diagnosis (served at /metrics).

Labels are bounded: message kinds, results and finding kinds, never job or rank names. The per-job
series (phase, health, conditions, detections, step and wait times) are computed at scrape time by
``job_metrics.JobMetrics`` and go with the job. Created once at the operator's start (see
``rankwatch.operator.operator_metrics``) and passed to what counts; nothing is registered at import.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class DiagnosisMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.collector_messages = Counter(
            "rankwatch_collector_messages_total",
            "Sidecar messages received by the collector, by kind (summary, stall) and result (accepted, "
            "duplicate, unauthorized, unknown_job, too_large, invalid, rate_limited, error)",
            ["kind", "result"],
            registry=registry,
        )
        self.collector_rank_windows = Counter(
            "rankwatch_collector_rank_windows_total", "Per-rank windows taken from accepted summaries",
            registry=registry,
        )  # fmt: skip
        self.collector_dropped = Counter(
            "rankwatch_collector_dropped_total",
            "Entries the collector did not keep because a job's state was full (what: rank, pod, comm, "
            "ended_pod); non-zero means a job sends more than its spec allows (or someone holding its token does)",
            ["what"],
            registry=registry,
        )
        self.suspicions = Counter(
            "rankwatch_detector_suspicions_total",
            "Suspicions raised by the detector, by the kind of finding suspected (hang, straggler, fail_slow)",
            ["kind"],
            registry=registry,
        )
        self.detector_seconds = Histogram(
            "rankwatch_detector_duration_seconds",
            "One run of the detector over one job's state (once per job per window, on the collector's event "
            "loop: summaries wait while it runs)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=registry,
        )
        pauses = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
        self.event_loop_lag_seconds = Histogram(
            "rankwatch_event_loop_lag_seconds",
            "How much later than asked a ticker on the operator's event loop woke, every 0.1 s (the collector's "
            "answers wait as long: garbage collections, the detector, or the process waiting for a CPU)",
            buckets=pauses,
            registry=registry,
        )
        self.gc_pause_seconds = Histogram(
            "rankwatch_gc_pause_seconds",
            "Each garbage collection of the operator's process by generation (0 young, 1 middle, 2 full); the "
            "event loop waits for it",
            ["generation"],
            buckets=pauses,
            registry=registry,
        )
        self.diagnoses = Counter(
            "rankwatch_diagnoses_total",
            "Diagnosis runs by outcome (finding, no_finding, failed, out_of_memory, timeout, crashed)",
            ["outcome"],
            registry=registry,
        )
        self.diagnoses_running = Gauge(
            "rankwatch_diagnoses_running", "Diagnoses running now (at most the configured concurrency)",
            registry=registry,
        )  # fmt: skip
        self.diagnoses_waiting = Gauge(
            "rankwatch_diagnoses_waiting", "Diagnoses queued for a free slot", registry=registry
        )
        self.diagnosis_peak_bytes = Histogram(
            "rankwatch_diagnosis_worker_peak_bytes",
            "Peak resident memory of a diagnosis's analysis worker",
            buckets=tuple(float(mib << 20) for mib in (32, 64, 128, 256, 384, 512, 768, 1024, 2048)),
            registry=registry,
        )
        self.diagnosis_seconds = Histogram(
            "rankwatch_diagnosis_duration_seconds",
            "From suspicion to the diagnosis written on the job (dumps fetched, analysis, writes)",
            buckets=(0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120),
            registry=registry,
        )
        self.recoveries = Counter(
            "rankwatch_recoveries_total", "Findings cleared because the job recovered", ["kind"], registry=registry
        )
        self.unwatched_pods = Gauge(
            "rankwatch_unwatched_pods",
            "Opted-in pods (annotation rankwatch.io/inject=true) running without rankwatch's injection, so not "
            "watched, by the kind owning them (unsupported: no kind rankwatch knows)",
            ["kind"],
            registry=registry,
        )

    @classmethod
    def uncounted(cls) -> DiagnosisMetrics:
        """Series nobody serves (a private registry): for parts run outside the operator (benches, tests)."""
        return cls(CollectorRegistry())

    def diagnoses_in_progress(self, running: int, waiting: int) -> None:
        self.diagnoses_running.set(running)
        self.diagnoses_waiting.set(waiting)

    def dropped(self, what: str, count: int = 1) -> None:
        self.collector_dropped.labels(what).inc(count)
