"""dashboards: each Grafana dashboard has the run's variables and the sidecar's labels."""

import json

from trainingrun_operator import dashboards


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
