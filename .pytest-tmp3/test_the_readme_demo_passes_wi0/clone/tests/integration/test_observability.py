"""A live `trainingrun local` run exposes metrics that promtool accepts, and a real Prometheus scraping it
answers every TrainingRun dashboard query (GPU panels excepted on CPU, by dashboards.GPU_PANELS)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from environments import inherited
from tiny_runs import tiny_trainer
from trainingrun_operator import dashboards, series

PROMTOOL, PROMETHEUS = shutil.which("promtool"), shutil.which("prometheus")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (PROMTOOL and PROMETHEUS) and not os.environ.get("TRAININGRUN_CI"),
        reason="needs Debian's prometheus (prometheus, promtool): bash scripts/install-test-tools.sh",
    ),
]
RUN = "observed"
DEADLINE_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def until(check, what: str):
    """Poll a condition on a live process or server (each poll is a real request) until it holds."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            result = check()
        except OSError:
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {DEADLINE_S} s")
        time.sleep(0.25)


@pytest.fixture
def live_run(tmp_path):
    """A 2-process local run that trains until stopped, serving its metrics; stopped with Ctrl-C after."""
    port = free_port()
    body = {
        "apiVersion": "trainingrun.dev/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {"name": RUN},
        "spec": {
            "trainer": tiny_trainer(
                maxSteps=1000000, logIntervalSteps=5, eval={"intervalSteps": 5, "batches": 1}, ema={"enabled": True}
            ),
            "checkpoint": {
                "uri": "file:///unused",
                "interval": {"steps": "auto", "minSteps": 5, "maxSteps": 20},
                "storageInterval": {"steps": "auto"},
            },
            "nprocPerNode": 2,
        },
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(body))
    env = inherited("TRAININGRUN_")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainingrun_operator.cli",
            "local",
            str(tmp_path / "run.yaml"),
            "--metrics-port",
            str(port),
            "--checkpoint-uri",
            f"file://{tmp_path}/ckpt",
            "--runs-dir",
            str(tmp_path / "runs"),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        until(lambda: "trainingrun_step{" in fetch(url) and 'rank="1"' in fetch(url), "steps from both ranks")
        yield port
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def test_live_exposition_passes_promtool_and_has_no_gpu_series(live_run):
    exposition = fetch(f"http://127.0.0.1:{live_run}/metrics")
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=exposition, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in ("0", "1"):
        assert f'trainingrun_loss{{namespace="default",rank="{rank}",run="{RUN}"}}' in exposition
    assert "trainingrun_checkpoint_saved_bytes_total" in exposition
    assert not [s for s in series.GPU_SERIES if s in exposition]  # absent, not zero, on CPU


def test_prometheus_answers_every_dashboard_query(live_run, tmp_path):
    prom_port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "trainer", "static_configs": [{"targets": [f"127.0.0.1:{live_run}"]}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    server = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def query(expr: str) -> list:
            url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
            answer = json.loads(fetch(url))
            assert answer["status"] == "success", answer
            return answer["data"]["result"]

        checked = 0
        for panel in dashboards.RUN_PANELS:
            if panel.title in dashboards.GPU_PANELS | dashboards.OPERATOR_PANELS:
                continue  # no GPU here; no operator under `trainingrun local` (tests/unit/operator/test_operator_metrics.py has its series)
            for expr, _ in panel.targets:
                concrete = expr.replace("$namespace", "default").replace("$run", RUN)
                until(lambda concrete=concrete: query(concrete), f"series for panel {panel.title!r}: {concrete}")
                checked += 1
        assert checked >= 15
        for panel in dashboards.RUN_PANELS:  # and the excepted ones really have nothing on CPU
            if panel.title in dashboards.GPU_PANELS:
                for expr, _ in panel.targets:
                    assert query(expr.replace("$namespace", "default").replace("$run", RUN)) == []
    finally:
        server.terminate()
        server.wait(timeout=30)
