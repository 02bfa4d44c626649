"""The operator's Prometheus metrics, served on /metrics next to /readyz.

Names follow the Prometheus conventions (base units, `_total` for counters). A registry per operator instance keeps
tests independent of each other.

    trainingrun_operator_runs{phase}                         TrainingRuns this operator sees, by phase
    trainingrun_operator_attempts_total{cause}               attempts started: initial, recovery, resume, recreate
    trainingrun_operator_restarts_total{namespace,run,cause}  attempts ended early: failure, preemption, stall
    trainingrun_operator_reconcile_duration_seconds          one reconcile, decision and API calls
    trainingrun_operator_api_errors_total{code}              failed Kubernetes API calls by HTTP status
    trainingrun_operator_events_dropped_total                Events logged but not posted: too many were waiting
    trainingrun_operator_objects_skipped_total{kind}         watch events of objects the operator could not read
    trainingrun_operator_ready                               1 when the CRD of the default backend is served
    trainingrun_operator_acting                              1 when this replica acts (0: another one does)
    trainingrun_operator_run_time_seconds{namespace,run,part} a run's wall time by part (status.timeBreakdown)
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from pydantic.alias_generators import to_camel

from trainingrun_api import run_figures

from .api_status import Phase

PHASES: tuple[str, ...] = Phase.__args__  # type: ignore[attr-defined]


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.phases: dict[tuple[str, str], str] = {}  #: (namespace, name) -> phase, for the runs gauge
        #: (namespace, name) -> status.timeBreakdown, for the run time gauge
        self.time_breakdowns: dict[tuple[str, str], dict] = {}
        self.attempts = Counter(
            "trainingrun_operator_attempts", "Attempts started, by cause.", ["cause"], registry=self.registry
        )
        self.restarts = Counter(
            "trainingrun_operator_restarts",
            "Attempts that ended early, by run and cause.",
            ["namespace", "run", "cause"],
            registry=self.registry,
        )
        self.hangs = Counter(
            "trainingrun_operator_hangs",
            "Hangs a rank of the run diagnosed (condition Hung turned true), by run.",
            ["namespace", "run"],
            registry=self.registry,
        )
        self.reconcile_seconds = Histogram(
            "trainingrun_operator_reconcile_duration_seconds",
            "Time to reconcile one TrainingRun.",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.api_errors = Counter(
            "trainingrun_operator_api_errors",
            "Failed Kubernetes API calls, by HTTP status.",
            ["code"],
            registry=self.registry,
        )
        self.events_dropped = Counter(
            "trainingrun_operator_events_dropped",
            "Events logged but not posted, because too many were waiting to be posted.",
            registry=self.registry,
        )
        self.objects_skipped = Counter(
            "trainingrun_operator_objects_skipped",
            "Watch events the operator skipped because it could not read their object (logged with its "
            "namespace and name; a run also gets the SpecRejected condition), by kind.",
            ["kind"],
            registry=self.registry,
        )
        self.report_connections_closed = Counter(
            "trainingrun_operator_report_connections_closed",
            "Connections to the report endpoint it refused or closed itself, by reason: over max_connections or "
            "max_connections_per_address, a body slower than the minimum rate (slow_body), or no whole request "
            "head before the idle timeout (no_request: idle and slow clients, or clients that gave up).",
            ["reason"],
            registry=self.registry,
        )
        self.ready = Gauge(
            "trainingrun_operator_ready",
            "1 when the CRD of the operator's default backend (PyTorchJob or JobSet) is served.",
            registry=self.registry,
        )
        self.acting = Gauge(
            "trainingrun_operator_acting",
            "1 when this replica acts; 0 while it stands by for another (replicaCount > 1).",
            registry=self.registry,
        )
        self.registry.register(_RunsByPhase(self))
        self.registry.register(_RunTime(self))

    def forget_run(self, namespace: str, run: str) -> None:
        """A deleted run's series go with it."""
        for cause in ("failure", "preemption", "stall"):
            try:
                self.restarts.remove(namespace, run, cause)
            except KeyError:
                pass
        try:
            self.hangs.remove(namespace, run)
        except KeyError:
            pass

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _RunsByPhase:
    """Counted at scrape time from what the operator last saw, so it never drifts."""

    def __init__(self, metrics: OperatorMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("trainingrun_operator_runs", "TrainingRuns by phase.", labels=["phase"])
        counts = {phase: 0 for phase in PHASES}
        for phase in list(self.metrics.phases.values()):
            counts[phase] = counts.get(phase, 0) + 1
        for phase, count in counts.items():
            family.add_metric([phase], count)
        yield family


#: (part, its status.timeBreakdown key): made once, not per run at each scrape (20,000 runs made 180,000 a scrape).
BREAKDOWN_KEYS = [(part, to_camel(f"{part}_seconds")) for part in run_figures.BREAKDOWN]


class _RunTime:
    """Each run's status.timeBreakdown as the operator last saw it, at scrape time: one series per part."""

    def __init__(self, metrics: OperatorMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "trainingrun_operator_run_time_seconds",
            "A run's wall time since it started, by part (status.timeBreakdown): productive, "
            "lost, startup, restore, checkpoint, data_wait, eval, backoff, other.",
            labels=["namespace", "run", "part"],
        )
        for (namespace, run), breakdown in list(self.metrics.time_breakdowns.items()):
            for part, key in BREAKDOWN_KEYS:
                seconds = breakdown.get(key)
                if seconds is not None:
                    family.add_metric([namespace, run, part], float(seconds))
        yield family
