"""The Grafana dashboards: one per run (its loss, throughput, GPUs, checkpoints and where its time went) and one of
the fleet (the operator's own series), generated from the panels below (monitoring.py writes them)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .series import RUN, object_metadata


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
        "Stragglers: each rank's time before the step's collectives",
        ((f"trainingrun_rank_compute_seconds{RUN}", "rank {{rank}}"),),
        unit="s",
    ),
    Panel(
        "Stragglers: slowest rank over the others' median",
        (
            (f"max(trainingrun_slowest_rank_ratio{RUN})", "ratio"),
            (f"max(trainingrun_slowest_rank{RUN})", "slowest rank"),
        ),
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
        "Checkpoint restores: bytes read by source",
        (
            (
                f"sum by (source) (increase(trainingrun_checkpoint_restore_bytes_total{RUN}[1h]))",
                "{{source}}",
            ),
        ),
        unit="bytes",
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
    templating: list[dict[str, Any]] = [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"}
    ]
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
        "metadata": object_metadata(
            "trainingrun-dashboard-"
            + file_name.removesuffix(".json").removeprefix("trainingrun-").replace("trainingrun", "run"),
            namespace,
            grafana_dashboard="1",
        ),
        "data": {file_name: json.dumps(body, indent=2, sort_keys=True)},
    }
