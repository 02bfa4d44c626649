"""Status reporting against a real local HTTP server: coalesced, rate-bounded, never blocking."""
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trainingrun_trainer.reporting import ApiEndpoint, StatusReporter

TOKEN = "sa-token-must-not-leak"


@pytest.fixture
def api_server():
    received = []

    class Handler(BaseHTTPRequestHandler):
        def do_PATCH(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append((self.path, dict(self.headers), body))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", received
    server.shutdown()


def test_reports_are_coalesced_and_the_newest_wins(api_server):
    url, received = api_server
    reporter = StatusReporter(ApiEndpoint(url, TOKEN, None), "team-a", "demo", min_interval_seconds=3600)
    for step in range(1, 101):
        reporter.report(progress={"step": step, "loss": 1.0 / step})
    reporter.report(lastGoodCheckpoint={"uri": "s3://bkt/step-100", "step": 100})
    reporter.close()
    # The first report may go out alone; everything after it waits for the interval and is merged.
    assert 1 <= len(received) <= 2
    path, headers, body = received[-1]
    assert path == "/apis/trainingrun.dev/v1alpha1/namespaces/team-a/trainingruns/demo/status"
    assert headers["Content-Type"] == "application/merge-patch+json"
    assert headers["Authorization"] == f"Bearer {TOKEN}"
    assert body["status"]["progress"]["step"] == 100
    assert body["status"]["lastGoodCheckpoint"]["step"] == 100


def test_unreachable_api_is_logged_once_and_never_raises(caplog):
    reporter = StatusReporter(ApiEndpoint("http://127.0.0.1:9", TOKEN, None), "ns", "demo",
                              min_interval_seconds=0, timeout_seconds=2)
    with caplog.at_level(logging.WARNING, logger="trainingrun.reporting"):
        for step in range(3):
            reporter.report(progress={"step": step})
        reporter.close()
    assert reporter.failures >= 1 and reporter.sent == 0
    warnings = [r for r in caplog.records if "cannot report status" in r.getMessage()]
    assert len(warnings) == 1
    assert TOKEN not in caplog.text


def test_outside_a_cluster_it_does_nothing(tmp_path):
    assert ApiEndpoint.in_cluster(env={}, account_dir=str(tmp_path)) is None
    reporter = StatusReporter(None, "ns", "demo")
    reporter.report(progress={"step": 1})
    reporter.close()
    assert not reporter.enabled and reporter.sent == 0


def test_in_cluster_endpoint_from_service_account(tmp_path):
    (tmp_path / "token").write_text(TOKEN + "\n")
    endpoint = ApiEndpoint.in_cluster(env={"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "6443"},
                                      account_dir=str(tmp_path))
    assert endpoint == ApiEndpoint("https://10.0.0.1:6443", TOKEN, None)


def test_local_status_url_wins_over_the_cluster(tmp_path):
    env = {"TRAININGRUN_STATUS_URL": "http://127.0.0.1:8123/", "TRAININGRUN_STATUS_TOKEN": "t",
           "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert ApiEndpoint.from_env(env) == ApiEndpoint("http://127.0.0.1:8123", "t", None)
    assert ApiEndpoint.from_env({}) is None
