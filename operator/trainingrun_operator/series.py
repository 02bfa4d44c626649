"""Every Prometheus series the trainer (trainingrun_trainer/metrics.py) and the operator (metrics.py) export, which the
alerts and dashboards (monitoring.py, dashboards.py) may name: a test checks each query against them."""

from __future__ import annotations

import re
from typing import Any

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
    "trainingrun_checkpoint_restore_bytes_total",
    "trainingrun_checkpoint_failures_total",
    "trainingrun_checkpoint_wait_seconds_total",
    "trainingrun_checkpoint_persist_lag_steps",
    "trainingrun_checkpoint_persist_failures_total",
    "trainingrun_nonfinite_steps_total",
    "trainingrun_rollbacks_total",
    "trainingrun_rank_compute_seconds",
    "trainingrun_slowest_rank_ratio",
    "trainingrun_slowest_rank",
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
    "trainingrun_operator_hangs_total",
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


def object_metadata(name: str, namespace: str, **labels: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": {**labels, "app.kubernetes.io/name": "trainingrun-operator"},
    }
