"""Alert rules, monitors and dashboards: generated, committed, checked by promtool, naming real series."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from trainingrun_operator import dashboards, monitoring, series

PROMTOOL = shutil.which("promtool")
# scripts/install-test-tools.sh (run by .ci/run) installs promtool and sets TRAININGRUN_CI, so there these tests run (and fail without it).
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None and not os.environ.get("TRAININGRUN_CI"),
    reason="needs promtool (Debian's prometheus): bash scripts/install-test-tools.sh",
)


def test_committed_files_are_generated():
    for relative, content in monitoring.files().items():
        assert (REPO / relative).read_text() == content, f"{relative} is stale: run `make monitoring`"


def test_every_query_names_only_exported_series():
    for expr in monitoring.every_expression():
        assert series.series_in(expr) <= series.SERIES, expr


def test_the_trainer_exports_exactly_the_listed_series():
    """TrainerMetrics (and its GPU poller, over a stand-in NVML) registers what monitoring lists."""
    script = """
import sys, types
fake = types.SimpleNamespace(
    nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: i, NVML_TEMPERATURE_GPU=0,
    nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=50),
    nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=1, total=2),
    nvmlDeviceGetTemperature=lambda h, s: 40, nvmlDeviceGetPowerUsage=lambda h: 1000,
    nvmlDeviceGetTotalEnergyConsumption=lambda h: 5)
sys.modules["pynvml"] = fake
from prometheus_client import REGISTRY
from trainingrun_trainer.metrics import TrainerMetrics
TrainerMetrics("r", "ns", 0, gpu_index=0, grid_intensity_g_per_kwh=400.0).close()
for family in REGISTRY.collect():
    if family.name.startswith("trainingrun_"):
        print(family.name + ("_total" if family.type == "counter" else ""))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert set(out.split()) == series.TRAINER_SERIES


def test_dashboards_have_the_run_variables_and_grafana_sidecar_labels():
    run = dashboards.dashboards()["trainingrun.json"]
    names = [v["name"] for v in run["templating"]["list"]]
    assert names == ["datasource", "namespace", "run"]
    for panel in run["panels"]:
        for target in panel["targets"]:
            assert 'namespace="$namespace", run="$run"' in target["expr"], panel["title"]
    for name, body in dashboards.dashboards().items():
        config_map = dashboards.dashboard_config_map(name, body)
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(config_map["data"][name]) == body
    fleet_titles = {p["title"] for p in dashboards.dashboards()["trainingrun-fleet.json"]["panels"]}
    assert {
        "Runs by phase",
        "Restarts by cause (1h)",
        "Goodput by run",
        "GPU-hours (24h)",
        "Energy (24h)",
    } <= fleet_titles


@needs_promtool
def test_rules_pass_promtool_check():
    result = subprocess.run(
        [PROMTOOL, "check", "rules", str(REPO / "manifests/monitoring/rules.yaml")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(monitoring.ALERTS)} rules found" in result.stdout


def render(template: str, labels: dict) -> str:
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: str(labels[m.group(1)]), template)


@needs_promtool
def test_each_alert_fires_on_its_condition_and_only_then(tmp_path):
    tests = yaml.safe_load((REPO / "tests/fixtures/alerts_test.yaml").read_text())
    alerts = {a.name: a for a in monitoring.ALERTS}
    tested = set()
    for case in tests["tests"]:
        for check in case["alert_rule_test"]:
            tested.add(check["alertname"])
            alert = alerts[check["alertname"]]
            for expected in check["exp_alerts"]:
                expected["exp_annotations"] = {
                    "summary": render(alert.summary, expected["exp_labels"]),
                    "description": render(alert.description, expected["exp_labels"]),
                }
    assert tested == set(alerts)  # every alert is exercised
    tests["rule_files"] = [str(REPO / "manifests/monitoring/rules.yaml")]
    path = tmp_path / "alerts_test.yaml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    result = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_a_broken_rule_is_caught(tmp_path):
    """The promtool checks above can fail: an alert that never fires fails its test."""
    rules = yaml.safe_load((REPO / "manifests/monitoring/rules.yaml").read_text())
    for rule in rules["groups"][0]["rules"]:
        if rule["alert"] == "TrainingRunCheckpointFailing":
            rule["expr"] = rule["expr"].replace("> 0", "> 100")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    tests = yaml.safe_load((REPO / "tests/fixtures/alerts_test.yaml").read_text())
    tests["rule_files"] = [str(tmp_path / "rules.yaml")]
    tests["tests"] = [
        t for t in tests["tests"] if any(c["alertname"] == "TrainingRunCheckpointFailing" for c in t["alert_rule_test"])
    ]
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(tests))
    result = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / "t.yaml")], capture_output=True, text=True)
    assert result.returncode != 0
