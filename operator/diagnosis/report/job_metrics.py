"""Per-job Prometheus series, computed at scrape time from what the operator already holds.

The chart's rules and dashboard read these (``helm/rankwatch/rules``, ``helm/rankwatch/dashboards``):

- ``rankwatch_job_phase{namespace,trainingjob,phase}``, ``rankwatch_job_health{…,health}``: 1 for the
  job's current value, 0 for the others (every known value is present, so a change never leaves a
  stale 1 behind and ``== 0`` can be asked); ``rankwatch_job_condition{…,condition}``: 1 while the
  condition is True. From the job's status as the last watch event carried it.
- ``rankwatch_detections_total{…,kind}``: diagnoses written onto the job, by finding kind; every kind
  starts at 0 when the job is first seen, so ``increase()`` sees the first detection.
- ``rankwatch_job_detector_runs_total{…}``: runs of the detector over the job's window summaries (one
  per window while its telemetry flows): how much evidence a job without a finding was judged on.
- ``rankwatch_job_step_seconds{…}``: median of the job's recent step times (sidecar summaries).
- ``rankwatch_rank_wait_seconds{…,rank}``: a rank's wait in NCCL collectives in its last window with
  collectives (the median over its communicators of the window's p50, kept by the job state).
  Bounded: all ranks up to ``rank_series_per_job``, beyond that the job's suspects, then the lowest
  waits (a straggler arrives last and waits least) and the highest.
- ``rankwatch_collector_last_summary_timestamp_seconds{…,pod}``: when the collector last accepted a
  summary from the pod (Unix time); only pods the job has now (one per node: as many series as
  kube-state-metrics has per pod).
- ``rankwatch_cordoned_nodes``: nodes rankwatch has cordoned now (dry runs excluded).

A job's series go when the job is deleted (``forget``). Nothing here is persisted or written to the
API: a restarted operator rebuilds it from the initial listing of jobs and the next summaries.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rankwatch.model.diagnosis_status import DiagnosisStatus
from rankwatch.model.finding import FindingKind
from rankwatch.operator.diagnosis.ingest.job_state import JobState, JobStore
from rankwatch.operator.lifecycle import job_status

PHASES = (job_status.PENDING, job_status.SUSPENDED, job_status.RUNNING, job_status.SUCCEEDED, job_status.FAILED)
HEALTHS = ("Unknown", "Healthy", "Degraded", "Hung")
DETECTION_KINDS = tuple(kind.value for kind in FindingKind)
"""The finding kinds of rankwatch.analysis (``Finding.kind``)."""
JOB_LABELS = ["namespace", "trainingjob"]


@dataclass(frozen=True)
class JobMetricsSettings:
    rank_series_per_job: int = 32
    """At most this many ``rankwatch_rank_wait_seconds`` series per job (suspects, lowest, highest)."""

    def __post_init__(self) -> None:
        if self.rank_series_per_job < 1:
            raise ValueError(f"rank_series_per_job must be at least 1, got {self.rank_series_per_job}")


@dataclass
class JobView:
    """What the exporter keeps of one job: its status fields and its detection counts."""

    phase: str = job_status.PENDING
    health: str = "Unknown"
    conditions: dict[str, bool] = field(default_factory=dict)
    suspects: tuple[int, ...] = ()
    pods: frozenset[str] | None = None  # the job's pods now; None until the pod index told us
    detections: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DETECTION_KINDS, 0))
    detector_runs: int = 0


class JobMetrics(Collector):
    """Register once on a registry; fed by the kopf handlers (``observe``, ``observe_pods``, ``forget``,
    ``observe_node``) and the monitor (``detected``); read by Prometheus through ``collect``."""

    def __init__(
        self,
        store: JobStore,
        settings: JobMetricsSettings | None = None,
        leading: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.settings = settings or JobMetricsSettings()
        self.leading = leading
        """A replica that does not lead exports none of these series (its view is not kept current)."""
        self._clock, self._wall_clock = clock, wall_clock
        self.jobs: dict[tuple[str, str], JobView] = {}
        self.cordoned: set[str] = set()

    # -- fed by the handlers and the monitor -----------------------------------------------------------
    def observe(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        view = self.jobs.setdefault((namespace, name), JobView())
        view.phase = str(status.get("phase") or job_status.PENDING)
        view.health = str(status.get("health") or "Unknown")
        view.conditions = {
            str(c["type"]): c.get("status") == "True" for c in status.get("conditions") or [] if c.get("type")
        }
        diagnosis = DiagnosisStatus.from_status(status)
        view.suspects = diagnosis.ranks if diagnosis and diagnosis.active else ()

    def observe_pods(self, namespace: str, name: str, pods: Iterable[str]) -> None:
        view = self.jobs.get((namespace, name))
        if view is not None:
            view.pods = frozenset(pods)

    def detected(self, namespace: str, name: str, kind: str) -> None:
        view = self.jobs.setdefault((namespace, name), JobView())
        view.detections[kind] = view.detections.get(kind, 0) + 1

    def judged(self, namespace: str, name: str) -> None:
        """The detector ran over the job's summaries once more."""
        self.jobs.setdefault((namespace, name), JobView()).detector_runs += 1

    def forget(self, namespace: str, name: str) -> None:
        self.jobs.pop((namespace, name), None)

    def observe_node(self, name: str, annotations: Mapping[str, str] | None, deleted: bool = False) -> None:
        from rankwatch.operator.remediation import node_marks

        annotations = annotations or {}
        cordoned = annotations.get(node_marks.CORDONED_BY) == node_marks.CORDONED_BY_VALUE
        if cordoned and not deleted and annotations.get(node_marks.DRY_RUN) != "true":
            self.cordoned.add(name)
        else:
            self.cordoned.discard(name)

    # -- scrape ---------------------------------------------------------------------------------------------
    def collect(self) -> Iterable[Metric]:
        if not self.leading():
            return
        yield GaugeMetricFamily("rankwatch_cordoned_nodes", "Nodes rankwatch cordoned", value=len(self.cordoned))
        phase = GaugeMetricFamily(
            "rankwatch_job_phase", "1 for the job's current phase, 0 for the others", labels=[*JOB_LABELS, "phase"]
        )
        health = GaugeMetricFamily(
            "rankwatch_job_health", "1 for the job's current health, 0 for the others", labels=[*JOB_LABELS, "health"]
        )
        condition = GaugeMetricFamily(
            "rankwatch_job_condition", "1 while the TrainingJob's condition is True", labels=[*JOB_LABELS, "condition"]
        )
        detections = CounterMetricFamily(
            "rankwatch_detections", "Diagnoses written onto the job, by finding kind", labels=[*JOB_LABELS, "kind"]
        )
        runs = CounterMetricFamily(
            "rankwatch_job_detector_runs",
            "Runs of the detector over the job's window summaries (one per window while its telemetry flows)",
            labels=JOB_LABELS,
        )
        step = GaugeMetricFamily(
            "rankwatch_job_step_seconds", "Median of the TrainingJob's recent step times", labels=JOB_LABELS
        )
        wait = GaugeMetricFamily(
            "rankwatch_rank_wait_seconds",
            "A rank's wait in NCCL collectives in its last window (median over communicators of the p50); "
            "bounded per job: suspects, lowest and highest waits",
            labels=[*JOB_LABELS, "rank"],
        )
        last_summary = GaugeMetricFamily(
            "rankwatch_collector_last_summary_timestamp_seconds",
            "When the collector last accepted a window summary from the pod (Unix time)",
            labels=[*JOB_LABELS, "pod"],
        )
        offset = self._wall_clock() - self._clock()  # monotonic -> Unix time
        for (namespace, name), view in sorted(self.jobs.items()):
            job = [namespace, name]
            for value in _with_current(PHASES, view.phase):
                phase.add_metric([*job, value], float(value == view.phase))
            for value in _with_current(HEALTHS, view.health):
                health.add_metric([*job, value], float(value == view.health))
            for type_ in _with_current(job_status.CONDITION_TYPES, *view.conditions):
                condition.add_metric([*job, type_], float(view.conditions.get(type_, False)))
            for kind, count in view.detections.items():
                detections.add_metric([*job, kind], count)
            runs.add_metric(job, view.detector_runs)
            state = self.store.peek(namespace, name)
            if state is None:
                continue
            recent_step = state.recent_step_time()
            if recent_step is not None:
                step.add_metric(job, recent_step)
            for rank, seconds in self._rank_waits(state, view.suspects):
                wait.add_metric([*job, str(rank)], seconds)
            for pod in state.pods.values():
                if pod.seen_at and (view.pods is None or pod.name in view.pods):
                    last_summary.add_metric([*job, pod.name], pod.seen_at + offset)
        yield from (phase, health, condition, detections, runs, step, wait, last_summary)

    def _rank_waits(self, state: JobState, suspects: tuple[int, ...]) -> list[tuple[int, float]]:
        waits = {rank: r.wait_s for rank, r in state.ranks.items() if r.wait_s is not None}
        limit = self.settings.rank_series_per_job
        if len(waits) <= limit:
            return sorted(waits.items())
        chosen = dict.fromkeys(rank for rank in suspects if rank in waits)
        room = max(0, limit - len(chosen))
        by_wait = [(wait, rank) for rank, wait in waits.items() if rank not in chosen]
        chosen.update(dict.fromkeys(rank for _, rank in heapq.nsmallest(room - room // 2, by_wait)))
        chosen.update(dict.fromkeys(rank for _, rank in heapq.nlargest(room // 2, by_wait)))
        return sorted((rank, waits[rank]) for rank in list(chosen)[:limit])


def _with_current(known: Iterable[str], *current: str) -> list[str]:
    """The known values plus any current one the code does not know yet (a newer CRD's)."""
    values = list(known)
    values.extend(value for value in current if value and value not in values)
    return values
