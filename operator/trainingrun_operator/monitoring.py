"""Alerts, scrape configuration and Grafana dashboards, generated from one place (the series in series.py, the
dashboards in dashboards.py, alerts and scraping here).

Every query names only series the trainer (trainingrun_trainer/metrics.py) or the operator
(metrics.py) export: `SERIES` lists them and a test checks each expression against it, and another
runs every TrainingRun dashboard query against a real Prometheus scraping a live local run.
`trainingrun monitoring --write .` (`make monitoring`) writes manifests/monitoring/; a test fails
when the committed files differ from what this module generates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import yaml

from . import naming
from .dashboards import FLEET_PANELS, RUN_PANELS, dashboard_config_map, dashboards
from .series import OPERATOR_JOB, object_metadata

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
        "TrainingRunHung",
        "sum by (namespace, run) (increase(trainingrun_operator_hangs_total[1h])) > 0",
        "0m",
        "warning",
        "TrainingRun {{ $labels.namespace }}/{{ $labels.run }} hung in the last hour",
        "A rank made no step progress for spec.recovery.hangTimeoutSeconds; the workers restarted in place. "
        "`kubectl describe trainingrun` (condition Hung) and `trainingrun logs RUN --hang` name the collective and "
        "the ranks, pods and nodes that held it up: a node named again and again may be faulty.",
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


def prometheus_rule(namespace: str = "trainingrun-system") -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": object_metadata("trainingrun", namespace),
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
        "metadata": object_metadata("trainingrun-trainers", namespace),
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
        "metadata": object_metadata(OPERATOR_JOB, namespace),
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
