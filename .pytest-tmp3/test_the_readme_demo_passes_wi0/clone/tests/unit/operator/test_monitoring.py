"""monitoring: the alert rules and monitors, generated and committed, checked by promtool, each alert firing on its
condition and only then. The dashboards: test_dashboards.py; the series they name: test_series.py."""

import os
import re
import shutil
import subprocess

import pytest
import yaml

from conftest import REPO
from trainingrun_operator import monitoring

PROMTOOL = shutil.which("promtool")


# scripts/install-test-tools.sh (run by .ci/run) installs promtool and sets TRAININGRUN_CI, so there these tests run (and fail without it).
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None and not os.environ.get("TRAININGRUN_CI"),
    reason="needs promtool (Debian's prometheus): bash scripts/install-test-tools.sh",
)


def test_committed_files_are_generated():
    for relative, content in monitoring.files().items():
        assert (REPO / relative).read_text() == content, f"{relative} is stale: run `make monitoring`"


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
