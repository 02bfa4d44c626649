"""Alerts, scrape configuration and Grafana dashboards, generated from one place.

Every query names only series the trainer (trainingrun_trainer/metrics.py) or the operator
(metrics.py) export: `SERIES` lists them and a test checks each expression against it, and another
runs every TrainingRun dashboard query against a real Prometheus scraping a live local run.
`trainingrun monitoring --write .` (`make monitoring`) writes manifests/monitoring/; a test fails
when the committed files differ from what this module generates.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import yaml

from . import naming

#: Every series a query may name, by exporter.
TRAINER_SERIES = {
    "trainingrun_step",
    "trainingrun_loss",
    "trainingrun_learning_rate",
    "trainingrun_grad_norm",
    "trainingrun_samples_per_second",
    "trainingrun_tokens_per_second",
    "trainingrun_last_step_timestamp_seconds",
    "trainingrun_model_flops_per_second",
    "trainingrun_mfu_ratio",
    "trainingrun_startup_seconds",
    "trainingrun_productive_seconds",
    "trainingrun_goodput_ratio",
    "trainingrun_attempt",
    "trainingrun_worker_group_restarts",
    "trainingrun_step_duration_seconds",
    "trainingrun_data_wait_seconds",
    "trainingrun_checkpoint_save_seconds",
    "trainingrun_checkpoint_restore_seconds",
    "trainingrun_checkpoint_saved_bytes_total",
    "trainingrun_checkpoint_failures_total",
    "trainingrun_checkpoint_wait_seconds_total",
    "trainingrun_checkpoint_persist_lag_steps",
    "trainingrun_checkpoint_persist_failures_total",
    "trainingrun_nonfinite_steps_total",
    "trainingrun_rollbacks_total",
    "trainingrun_gpu_utilization_ratio",
    "trainingrun_gpu_memory_used_bytes",
    "trainingrun_gpu_memory_total_bytes",
    "trainingrun_gpu_temperature_celsius",
    "trainingrun_gpu_power_watts",
    "trainingrun_gpu_energy_joules_total",
    "trainingrun_emissions_grams_total",
    "trainingrun_eval_loss",
    "trainingrun_eval_loss_ema",
    "trainingrun_eval_step",
    "trainingrun_checkpoint_interval_steps",
    "trainingrun_checkpoint_save_cost_seconds",
    "trainingrun_checkpoint_expected_lost_seconds",
    "trainingrun_checkpoint_storage_interval_steps",
    "trainingrun_checkpoint_persist_cost_seconds",
}
OPERATOR_SERIES = {
    "trainingrun_operator_runs",
    "trainingrun_operator_attempts_total",
    "trainingrun_operator_restarts_total",
    "trainingrun_operator_reconcile_duration_seconds",
    "trainingrun_operator_api_errors_total",
    "trainingrun_operator_ready",
    "trainingrun_operator_acting",
    "trainingrun_operator_run_time_seconds",
}
SERIES = TRAINER_SERIES | OPERATOR_SERIES | {"up"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
GPU_SERIES = {s for s in TRAINER_SERIES if s.startswith("trainingrun_gpu_") or s.startswith("trainingrun_emissions")}

OPERATOR_JOB = "trainingrun-operator"
RUN = '{namespace="$namespace", run="$run"}'


def series_in(expr: str) -> set[str]:
    """Metric names an expression reads; a histogram's _bucket/_sum/_count count as the histogram."""
    found = set()
    for name in re.findall(r"\b(?:trainingrun_[a-z_]+|up)\b", expr):
        for suffix in HISTOGRAM_SUFFIXES:
            if name.endswith(suffix) and name[: -len(suffix)] in SERIES:
                name = name[: -len(suffix)]
        found.add(name)
    return found


# ---------------------------------------------------------------- alerts


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str

    def rule(self) -> dict[str, Any]:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {"summary": self.summary, "description": self.description},
        }


ALERTS = [
    Alert(
        "TrainingRunStalled",
        "time() - max by (namespace, run) (trainingrun_last_step_timestamp_seconds) > 900",
        "5m",
        "warning",
        "TrainingRun {{ $labels.namespace }}/{{ $labels.run }} has made no step for 15 minutes",
        "No rank completed a step for more than 15 minutes. Check the pods' logs; the operator "
        "restarts attempts after spec.recovery.stallTimeoutSeconds.",
    ),
    Alert(
        "TrainingRunLossNotFinite",
        "max by (namespace, run) (increase(trainingrun_nonfinite_steps_total[10m])) > 0",
        "0m",
        "warning",
        "TrainingRun {{ $labels.namespace }}/{{ $labels.run }} had non-finite losses or gradients",
        "Steps were skipped or rolled back in the last 10 minutes; the run stops itself when "
        "spec.trainer.health's limits are reached. Lower the learning rate or check the data.",
    ),
    Alert(
        "TrainingRunRestartingOften",
        "sum by (namespace, run) (increase(trainingrun_operator_restarts_total[1h])) > 3",
        "0m",
        "warning",
        "TrainingRun {{ $labels.namespace }}/{{ $labels.run }} restarted more than 3 times in an hour",
        "See `kubectl describe trainingrun` for the causes (failures, preemptions, stalls); each restart "
        "loses the steps since the last checkpoint.",
    ),
    Alert(
        "TrainingRunGPUIdle",
        "avg by (namespace, run) (trainingrun_gpu_utilization_ratio) < 0.1",
        "15m",
        "info",
        "TrainingRun {{ $labels.namespace }}/{{ $labels.run }} keeps its GPUs under 10% busy",
        "Average GPU utilization has been under 10% for 15 minutes: the input pipeline may be the "
        "bottleneck (see data wait), or the run is idle and holding GPUs.",
    ),
    Alert(
        "TrainingRunCheckpointFailing",
        "max by (namespace, run) (increase(trainingrun_checkpoint_failures_total[30m])) > 0",
        "0m",
        "critical",
        "TrainingRun {{ $labels.namespace }}/{{ $labels.run }} failed to commit a checkpoint",
        "A crash now would lose everything since the last good checkpoint. Check storage credentials, "
        "quota and reachability of spec.checkpoint.uri.",
    ),
    Alert(
        "OperatorDown",
        f'absent(up{{job="{OPERATOR_JOB}"}} == 1)',
        "5m",
        "critical",
        "The trainingrun-operator is not being scraped as up",
        "No operator replica answered Prometheus for 5 minutes: failed attempts are not recovered and "
        "status is not updated until it is back.",
    ),
    Alert(
        "OperatorNoReplicaActing",
        f'max(trainingrun_operator_acting{{job="{OPERATOR_JOB}"}}) == 0',
        "5m",
        "critical",
        "Every trainingrun-operator replica stands by",
        "Replicas are up but none acts (kopf peering paused them all, or they cannot read their peering "
        "object): runs are not reconciled. Check the operator logs for 'standing by' and the KopfPeering "
        "object's status.",
    ),
]


def _metadata(name: str, namespace: str, **labels: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": {**labels, "app.kubernetes.io/name": "trainingrun-operator"},
    }


def prometheus_rule(namespace: str = "trainingrun-system") -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": _metadata("trainingrun", namespace),
        "spec": {"groups": [{"name": "trainingrun", "rules": [a.rule() for a in ALERTS]}]},
    }


def rules_file() -> dict[str, Any]:
    """The same rules as a plain Prometheus rules file (for promtool and non-operator setups)."""
    return {"groups": prometheus_rule()["spec"]["groups"]}


def pod_monitor(namespace: str = "trainingrun-system") -> dict[str, Any]:
    """Scrapes every trainer pod's launcher endpoint (all its ranks), selected by the run labels."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _metadata("trainingrun-trainers", namespace),
        "spec": {
            "namespaceSelector": {"any": True},
            "selector": {
                "matchLabels": {"app.kubernetes.io/name": "trainingrun", "app.kubernetes.io/component": "trainer"},
                "matchExpressions": [{"key": naming.LABEL_RUN, "operator": "Exists"}],
            },
            # The series carry run, namespace and rank themselves; honorLabels keeps them as they are
            # (the target's own namespace label would otherwise rename theirs to exported_namespace).
            "podMetricsEndpoints": [{"port": "metrics", "interval": "15s", "honorLabels": True}],
        },
    }


def service_monitor(namespace: str = "trainingrun-system") -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _metadata(OPERATOR_JOB, namespace),
        "spec": {
            "selector": {
                "matchLabels": {
                    "app.kubernetes.io/name": "trainingrun-operator",
                    "app.kubernetes.io/component": "operator",
                }
            },
            "endpoints": [
                {
                    "port": "metrics",
                    "interval": "30s",
                    "relabelings": [{"targetLabel": "job", "replacement": OPERATOR_JOB}],
                }
            ],
        },
    }


# ---------------------------------------------------------------- dashboards


@dataclass(frozen=True)
class Panel:
    title: str
    targets: tuple[tuple[str, str], ...]  #: (expr, legend)
    unit: str = "short"
    kind: str = "timeseries"


RUN_PANELS = [
    Panel("Loss", ((f"trainingrun_loss{RUN}", "rank {{rank}}"),)),
    Panel(
        "Eval loss (held-out split)",
        (
            (f"max(trainingrun_eval_loss{RUN})", "eval loss"),
            (f"max(trainingrun_eval_loss_ema{RUN})", "eval loss, EMA weights"),
        ),
    ),
    Panel("Learning rate", ((f"max(trainingrun_learning_rate{RUN})", "lr"),)),
    Panel("Gradient norm", ((f"max(trainingrun_grad_norm{RUN})", "grad norm"),)),
    Panel("Step", ((f"max(trainingrun_step{RUN})", "step"),), kind="stat"),
    Panel(
        "Throughput",
        (
            (f"max(trainingrun_samples_per_second{RUN})", "samples/s"),
            (f"max(trainingrun_tokens_per_second{RUN})", "tokens/s"),
        ),
    ),
    Panel(
        "Model FLOP/s",
        (
            (f"sum(trainingrun_model_flops_per_second{RUN})", "run"),
            (f"trainingrun_model_flops_per_second{RUN}", "rank {{rank}}"),
        ),
        unit="flops",
    ),
    Panel(
        "MFU",
        ((f"avg(trainingrun_mfu_ratio{RUN})", "run"), (f"trainingrun_mfu_ratio{RUN}", "rank {{rank}}")),
        unit="percentunit",
    ),
    Panel(
        "Step time p50 / p95",
        (
            (f"histogram_quantile(0.5, sum by (le) (rate(trainingrun_step_duration_seconds_bucket{RUN}[5m])))", "p50"),
            (f"histogram_quantile(0.95, sum by (le) (rate(trainingrun_step_duration_seconds_bucket{RUN}[5m])))", "p95"),
        ),
        unit="s",
    ),
    Panel(
        "Data wait per step",
        (
            (
                f"sum by (rank) (rate(trainingrun_data_wait_seconds_sum{RUN}[5m])) / "
                f"sum by (rank) (rate(trainingrun_data_wait_seconds_count{RUN}[5m]))",
                "rank {{rank}}",
            ),
        ),
        unit="s",
    ),
    Panel(
        "GPU utilization",
        ((f"trainingrun_gpu_utilization_ratio{RUN}", "rank {{rank}} gpu {{gpu}}"),),
        unit="percentunit",
    ),
    Panel(
        "GPU memory",
        (
            (f"trainingrun_gpu_memory_used_bytes{RUN}", "used rank {{rank}}"),
            (f"trainingrun_gpu_memory_total_bytes{RUN}", "total rank {{rank}}"),
        ),
        unit="bytes",
    ),
    Panel("GPU power", ((f"trainingrun_gpu_power_watts{RUN}", "rank {{rank}}"),), unit="watt"),
    Panel(
        "Checkpoint save time",
        (
            (
                f"sum(rate(trainingrun_checkpoint_save_seconds_sum{RUN}[15m])) / "
                f"sum(rate(trainingrun_checkpoint_save_seconds_count{RUN}[15m]))",
                "mean save",
            ),
            (
                f"max(rate(trainingrun_checkpoint_wait_seconds_total{RUN}[15m]))",
                "training waiting for the previous save (s/s)",
            ),
        ),
        unit="s",
    ),
    Panel(
        "Checkpoint in memory ahead of storage",
        ((f"max(trainingrun_checkpoint_persist_lag_steps{RUN})", "steps not yet in storage"),),
    ),
    Panel(
        "Checkpoint bytes written",
        ((f"sum(rate(trainingrun_checkpoint_saved_bytes_total{RUN}[15m]))", "bytes/s"),),
        unit="Bps",
    ),
    Panel(
        "Checkpoint failures and restores",
        (
            (f"sum(trainingrun_checkpoint_failures_total{RUN})", "failed saves"),
            (f"sum(trainingrun_checkpoint_persist_failures_total{RUN})", "not copied to storage"),
            (f"sum(trainingrun_checkpoint_restore_seconds_count{RUN})", "restores"),
        ),
    ),
    Panel(
        "Checkpoint interval (steps: auto)",
        (
            (f"max(trainingrun_checkpoint_interval_steps{RUN})", "interval (steps)"),
            (f"max(trainingrun_checkpoint_expected_lost_seconds{RUN})", "lost per failure (s)"),
            (f"max(trainingrun_checkpoint_save_cost_seconds{RUN})", "save cost (s)"),
        ),
    ),
    Panel(
        "Storage interval (storageInterval.steps: auto)",
        (
            (f"max(trainingrun_checkpoint_storage_interval_steps{RUN})", "copied to storage every (steps)"),
            (f"max(trainingrun_checkpoint_persist_cost_seconds{RUN})", "copy cost (s)"),
        ),
    ),
    Panel(
        "Restarts",
        (
            (f"max(trainingrun_attempt{RUN}) - 1", "new attempts"),
            (f"max(trainingrun_worker_group_restarts{RUN})", "in-place restarts (this attempt)"),
        ),
    ),
    Panel(
        "Non-finite steps and rollbacks",
        (
            (f"sum(trainingrun_nonfinite_steps_total{RUN})", "non-finite"),
            (f"sum(trainingrun_rollbacks_total{RUN})", "rollbacks"),
        ),
    ),
    Panel(
        "Goodput (this attempt)",
        ((f"min(trainingrun_goodput_ratio{RUN})", "goodput"),),
        unit="percentunit",
        kind="stat",
    ),
    Panel(
        "Where the time went (since the run started)",
        ((f"max by (part) (trainingrun_operator_run_time_seconds{RUN})", "{{part}}"),),
        unit="s",
    ),
]
#: Panels that have no series without a GPU (the live-scrape test on CPU skips exactly these).
GPU_PANELS = {"GPU utilization", "GPU memory", "GPU power", "MFU"}
#: Panels of the operator's series (status.timeBreakdown): scraped from the operator, not from trainer pods.
OPERATOR_PANELS = {"Where the time went (since the run started)"}
#: Panels with data only when the run evaluates (spec.trainer.eval.intervalSteps > 0).
EVAL_PANELS = {"Eval loss (held-out split)"}
#: Panels with data only when the run lets the trainer choose its checkpoint intervals (checkpoint.interval.steps: auto;
#: persisting behind, storageInterval.steps: auto).
AUTO_INTERVAL_PANELS = {"Checkpoint interval (steps: auto)", "Storage interval (storageInterval.steps: auto)"}

FLEET_PANELS = [
    Panel("Runs by phase", (("sum by (phase) (trainingrun_operator_runs)", "{{phase}}"),)),
    Panel(
        "Restarts by cause (1h)", (("sum by (cause) (increase(trainingrun_operator_restarts_total[1h]))", "{{cause}}"),)
    ),
    Panel(
        "Goodput by run",
        (("min by (namespace, run) (trainingrun_goodput_ratio)", "{{namespace}}/{{run}}"),),
        unit="percentunit",
    ),
    Panel(
        "MFU by run",
        (("avg by (namespace, run) (trainingrun_mfu_ratio)", "{{namespace}}/{{run}}"),),
        unit="percentunit",
    ),
    Panel(
        "GPU-hours (24h)",
        (("sum(count_over_time(trainingrun_gpu_utilization_ratio[24h:1m])) / 60", "GPU-hours"),),
        kind="stat",
    ),
    Panel("Energy (24h)", (("sum(increase(trainingrun_gpu_energy_joules_total[24h])) / 3.6e6", "kWh"),), kind="stat"),
    Panel("Operator API errors", (("sum by (code) (rate(trainingrun_operator_api_errors_total[5m]))", "{{code}}"),)),
    Panel(
        "Reconcile p95",
        (
            (
                "histogram_quantile(0.95, sum by (le) "
                "(rate(trainingrun_operator_reconcile_duration_seconds_bucket[5m])))",
                "p95",
            ),
        ),
        unit="s",
    ),
]


def dashboard(title: str, uid: str, panels: list[Panel], variables: bool) -> dict[str, Any]:
    built = []
    for index, panel in enumerate(panels):
        built.append(
            {
                "id": index + 1,
                "type": panel.kind,
                "title": panel.title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": (index % 2) * 12, "y": (index // 2) * 8},
                "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
                "targets": [
                    {
                        "refId": chr(ord("A") + i),
                        "expr": expr,
                        "legendFormat": legend,
                        "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    }
                    for i, (expr, legend) in enumerate(panel.targets)
                ],
            }
        )
    templating = [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"}]
    if variables:
        templating += [
            {
                "name": "namespace",
                "type": "query",
                "label": "Namespace",
                "refresh": 2,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "query": {"query": "label_values(trainingrun_step, namespace)", "refId": "namespace"},
            },
            {
                "name": "run",
                "type": "query",
                "label": "Run",
                "refresh": 2,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "query": {"query": 'label_values(trainingrun_step{namespace="$namespace"}, run)', "refId": "run"},
            },
        ]
    return {
        "title": title,
        "uid": uid,
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "tags": ["trainingrun"],
        "templating": {"list": templating},
        "panels": built,
    }


def dashboards() -> dict[str, dict[str, Any]]:
    return {
        "trainingrun.json": dashboard("TrainingRun", "trainingrun-run", RUN_PANELS, variables=True),
        "trainingrun-fleet.json": dashboard("TrainingRun fleet", "trainingrun-fleet", FLEET_PANELS, variables=False),
    }


def dashboard_config_map(file_name: str, body: dict[str, Any], namespace: str = "trainingrun-system") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(
            "trainingrun-dashboard-"
            + file_name.removesuffix(".json").removeprefix("trainingrun-").replace("trainingrun", "run"),
            namespace,
            grafana_dashboard="1",
        ),
        "data": {file_name: json.dumps(body, indent=2, sort_keys=True)},
    }


def every_expression() -> list[str]:
    exprs = [a.expr for a in ALERTS]
    for panels in (RUN_PANELS, FLEET_PANELS):
        exprs += [expr for panel in panels for expr, _ in panel.targets]
    return exprs


def files() -> dict[str, str]:
    """manifests/monitoring/: relative path -> content."""
    dump = lambda obj: yaml.safe_dump(obj, sort_keys=False, width=120)  # noqa: E731
    out = {
        "manifests/monitoring/prometheusrule.yaml": dump(prometheus_rule()),
        "manifests/monitoring/podmonitor.yaml": dump(pod_monitor()),
        "manifests/monitoring/servicemonitor.yaml": dump(service_monitor()),
        "manifests/monitoring/rules.yaml": "# The PrometheusRule's rules as a plain rules file (promtool, "
        "Prometheus without the operator).\n" + dump(rules_file()),
    }
    for name, body in dashboards().items():
        out[f"manifests/monitoring/dashboards/{name}"] = json.dumps(body, indent=2, sort_keys=True) + "\n"
        out[f"manifests/monitoring/dashboard-{name.removesuffix('.json')}.yaml"] = dump(
            dashboard_config_map(name, body)
        )
    # The chart templates the same objects (namespace and extra labels set at install).
    for relative, content in list(out.items()):
        if relative.endswith(".yaml") and not relative.endswith("rules.yaml"):
            out["charts/trainingrun-operator/files/monitoring/" + relative.rsplit("/", 1)[1]] = content
    return out
