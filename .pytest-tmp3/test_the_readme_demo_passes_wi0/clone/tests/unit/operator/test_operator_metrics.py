"""The operator's own Prometheus series (metrics.py), read from its exposition."""

from prometheus_client.parser import text_string_to_metric_families

from trainingrun_operator import series
from trainingrun_operator.metrics import OperatorMetrics


def samples(metrics: OperatorMetrics, name: str) -> dict[tuple, float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
        if s.name == name
    }


def test_each_runs_time_breakdown_is_a_series_per_part_until_the_run_is_forgotten():
    metrics = OperatorMetrics()
    metrics.time_breakdowns[("team-a", "demo")] = {
        "wallSeconds": 60.0,
        "productiveSeconds": 40.0,
        "lostSeconds": 2.5,
        "dataWaitSeconds": 1.5,
    }
    found = samples(metrics, "trainingrun_operator_run_time_seconds")
    assert found == {
        (("namespace", "team-a"), ("part", "productive"), ("run", "demo")): 40.0,
        (("namespace", "team-a"), ("part", "lost"), ("run", "demo")): 2.5,
        (("namespace", "team-a"), ("part", "data_wait"), ("run", "demo")): 1.5,
    }
    assert "trainingrun_operator_run_time_seconds" in series.OPERATOR_SERIES  # the dashboard may name it
    metrics.time_breakdowns.pop(("team-a", "demo"))
    assert samples(metrics, "trainingrun_operator_run_time_seconds") == {}
