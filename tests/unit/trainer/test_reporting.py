"""Progress reporting against a real local HTTP server: newest values, heartbeats, rotated tokens,
never blocking, never leaking the token."""

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trainingrun_api import contract, progress_report
from trainingrun_api.progress_report import CommittedCheckpoint, Progress, Report
from trainingrun_trainer import reporting
from trainingrun_trainer.reporting import ProgressReporter, ReportEndpoint, from_env

TOKEN = "projected-token-must-not-leak"
IDENTITY = Report("team-a", "demo", "uid-1", 2)


@pytest.fixture
def endpoint():
    received = []
    arrived = threading.Condition()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with arrived:
                received.append((self.path, dict(self.headers), Report.from_json(body)))
                arrived.notify_all()
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def wait_until(check, timeout=30):
        deadline = time.monotonic() + timeout
        with arrived:
            while not check(received):
                assert time.monotonic() < deadline, f"not received: {received[-3:]}"
                arrived.wait(deadline - time.monotonic())

    yield f"http://127.0.0.1:{server.server_address[1]}{contract.REPORT_PATH}", received, wait_until
    server.shutdown()


def progress(step):
    return Progress(step=step, updated_at="2026-11-24T00:00:00Z", loss=1.0 / step)


def test_the_newest_values_are_sent_with_the_runs_identity(endpoint, tmp_path):
    url, received, wait_until = endpoint
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    reporter = ProgressReporter(ReportEndpoint(url, str(token), None), IDENTITY, interval_seconds=3600)
    for step in range(1, 101):
        reporter.progress(progress(step))
    reporter.committed(CommittedCheckpoint("s3://bkt/demo/step-00000100", 100, "2026-11-24T00:00:00Z"))
    reporter.close()
    # One report at start (whatever was there), one on close with the newest of everything.
    assert 1 <= len(received) <= 2
    path, headers, report = received[-1]
    assert path == contract.REPORT_PATH and headers["Authorization"] == f"Bearer {TOKEN}"
    assert (report.namespace, report.name, report.uid, report.attempt) == ("team-a", "demo", "uid-1", 2)
    assert report.progress.step == 100 and report.last_good_checkpoint.step == 100


def test_heartbeats_repeat_the_last_values_and_a_rotated_token_is_used(endpoint, tmp_path):
    """Nothing new is still reported (the operator tells a stalled trainer from an outage by it), and the
    token file is read at each report: the kubelet replaces a projected token before it expires."""
    url, received, wait_until = endpoint
    token = tmp_path / "token"
    token.write_text("first")
    reporter = ProgressReporter(ReportEndpoint(url, str(token), None), IDENTITY, interval_seconds=0.05)
    reporter.progress(progress(7))
    wait_until(lambda r: sum(1 for _, _, report in r if report.progress and report.progress.step == 7) >= 3)
    token.write_text("rotated")
    wait_until(lambda r: r[-1][1]["Authorization"] == "Bearer rotated")
    reporter.close()
    assert {report.progress.step for _, _, report in received if report.progress} == {7}


@pytest.mark.slow
def test_news_goes_at_once_the_restore_point_the_first_step_and_each_committed_checkpoint(endpoint, tmp_path):
    """With an interval of an hour, only news is sent before close: status shows a resumed run training at its first
    step, not a report interval later."""
    url, received, wait_until = endpoint
    token = tmp_path / "token"
    token.write_text(TOKEN)
    reporter = ProgressReporter(ReportEndpoint(url, str(token), None), IDENTITY, interval_seconds=3600)
    wait_until(lambda r: len(r) == 1)  # at start: who it is
    reporter.progress(progress(100))  # where the restored run stands, before its first step
    wait_until(lambda r: any(report.progress and report.progress.step == 100 for _, _, report in r))
    for step in range(101, 121):
        reporter.progress(progress(step))  # the first step is news; the steps after it wait for the interval
    wait_until(lambda r: any(report.progress and report.progress.step >= 101 for _, _, report in r))
    reporter.committed(CommittedCheckpoint("s3://bkt/demo/step-00000120", 120, "2026-11-24T00:00:00Z"))
    wait_until(lambda r: any(report.last_good_checkpoint for _, _, report in r))
    sent = len(received)
    reporter.committed(CommittedCheckpoint("s3://bkt/demo/step-00000120", 120, "2026-11-24T00:00:00Z"))  # not news
    reporter.close()
    assert sent <= 4 and len(received) == sent + 1  # the close sends the newest values once more
    assert received[-1][2].progress.step == 120


@pytest.mark.slow
def test_a_checkpoint_in_memory_is_not_news_it_goes_with_the_next_report(endpoint, tmp_path):
    """Persisting behind, a checkpoint every few steps must not mean a report every few steps."""
    url, received, wait_until = endpoint
    token = tmp_path / "token"
    token.write_text(TOKEN)
    reporter = ProgressReporter(ReportEndpoint(url, str(token), None), IDENTITY, interval_seconds=3600)
    wait_until(lambda r: len(r) == 1)  # at start: who it is
    for step in range(10, 60, 10):
        reporter.committed_in_memory(progress_report.CheckpointInMemory(step, "2026-11-24T00:00:00Z"))
    reporter.committed(CommittedCheckpoint("s3://bkt/demo/step-00000030", 30, "2026-11-24T00:00:00Z"))  # news
    wait_until(lambda r: any(report.last_good_checkpoint for _, _, report in r))
    assert len(received) == 2 and received[-1][2].checkpoint_in_memory.step == 50
    reporter.committed_in_memory(progress_report.CheckpointInMemory(60, "2026-11-24T00:00:01Z"))
    reporter.close()
    assert len(received) == 3 and received[-1][2].checkpoint_in_memory.step == 60


def test_an_unreachable_endpoint_is_logged_once_and_never_raises(caplog, tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    reporter = ProgressReporter(
        ReportEndpoint("http://127.0.0.1:9/v1/reports", str(token), None),
        IDENTITY,
        interval_seconds=0.01,
        timeout_seconds=2,
    )
    with caplog.at_level(logging.WARNING, logger="trainingrun.reporting"):
        for step in range(1, 4):
            reporter.progress(progress(step))
        deadline = time.monotonic() + 30
        while reporter.failures < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)  # polling a counter the reporter's own thread raises
        reporter.close()
    assert reporter.sent == 0
    assert len([r for r in caplog.records if "cannot report progress" in r.getMessage()]) == 1
    assert TOKEN not in caplog.text


def test_without_a_report_url_nothing_is_sent():
    reporter = from_env(IDENTITY, env={})
    reporter.progress(progress(1))
    reporter.close()
    assert not reporter.enabled and reporter.sent == 0


def test_endpoint_from_the_contracts_environment():
    env = {
        contract.REPORT_URL: "https://op.ns.svc:8443/v1/reports",
        contract.REPORT_TOKEN_FILE: "/t",
        contract.REPORT_CA_FILE: "/ca.crt",
        contract.REPORT_INTERVAL_SECONDS: "2.5",
    }
    reporter = from_env(IDENTITY, env=env)
    try:
        assert reporter.endpoint == ReportEndpoint("https://op.ns.svc:8443/v1/reports", "/t", "/ca.crt")
        assert reporter.interval == 2.5
    finally:
        reporter._stop.set()


@pytest.mark.parametrize(
    "body, field",
    [
        ({"name": "demo", "uid": "u", "attempt": 1}, "namespace"),
        ({"namespace": "ns", "name": "demo", "uid": "u", "attempt": 0}, "attempt"),
        ({"namespace": "ns", "name": "demo", "uid": "u", "attempt": 1, "progress": {"step": -1}}, "progress.step"),
        (
            {
                "namespace": "ns",
                "name": "demo",
                "uid": "u",
                "attempt": 1,
                "progress": {"step": 1, "updatedAt": "2026-11-24T00:00:00Z", "loss": "nan"},
            },
            "progress.loss",
        ),
        (
            {
                "namespace": "ns",
                "name": "demo",
                "uid": "u",
                "attempt": 1,
                "lastGoodCheckpoint": {"uri": "s3://b/x/step-00000001", "step": 1, "time": "yesterday"},
            },
            "lastGoodCheckpoint.time",
        ),
        (
            {
                "namespace": "ns",
                "name": "demo",
                "uid": "u",
                "attempt": 1,
                "checkpointInMemory": {"step": -3, "time": "2026-11-24T00:00:00Z"},
            },
            "checkpointInMemory.step",
        ),
        (
            {"namespace": "ns", "name": "demo", "uid": "u", "attempt": 1, "checkpointInMemory": {"step": 3, "time": 5}},
            "checkpointInMemory.time",
        ),
        (
            {
                "namespace": "ns",
                "name": "demo",
                "uid": "u",
                "attempt": 1,
                "processTime": {"process": "pod/1/2", "restoreSeconds": -1},
            },
            "processTime.restoreSeconds",
        ),
        (
            {"namespace": "ns", "name": "demo", "uid": "u", "attempt": 1, "processTime": {"aliveSeconds": 1}},
            "processTime.process",
        ),
        (
            {
                "namespace": "ns",
                "name": "demo",
                "uid": "u",
                "attempt": 1,
                "checkpointInterval": {"steps": 0, "failures": 0, "secondsBetweenFailures": 60},
            },
            "checkpointInterval.steps",
        ),
        (
            {
                "namespace": "ns",
                "name": "demo",
                "uid": "u",
                "attempt": 1,
                "checkpointInterval": {"steps": 5, "failures": 0, "secondsBetweenFailures": 60, "saveCostSeconds": -1},
            },
            "checkpointInterval.saveCostSeconds",
        ),
        (
            {
                "namespace": "ns",
                "name": "demo",
                "uid": "u",
                "attempt": 1,
                "checkpointInterval": {"steps": 5, "failures": 0},
            },
            "checkpointInterval.secondsBetweenFailures",
        ),
    ],
)
def test_a_malformed_report_names_its_field(body, field):
    with pytest.raises(progress_report.ReportError, match=field.replace(".", r"\.")):
        Report.from_json(json.dumps(body).encode())


def test_a_process_time_goes_over_the_wire_and_back_but_not_into_status():
    times = progress_report.ProcessTime("pod-0/41/1764000000", 30.5, 4.25, 0.5, 1.0, 0.75, 22.0, 0.0, 12.0)
    report = Report("ns", "demo", "u", 1, process_time=times)
    assert Report.from_json(report.to_json()).process_time == times
    assert report.status_fields() == {}  # the operator keeps its own account of time (a later part of issue 19)


def test_the_auto_intervals_choice_goes_over_the_wire_into_status():
    choice = progress_report.IntervalChoice(
        steps=120,
        seconds=12.0,
        save_cost_seconds=0.05,
        seconds_between_failures=600.0,
        failures=2,
        expected_lost_seconds=6.0,
    )
    report = Report("ns", "demo", "u", 1, checkpoint_interval=choice)
    assert Report.from_json(report.to_json()).checkpoint_interval == choice
    assert report.status_fields() == {
        "checkpointInterval": {
            "steps": 120,
            "seconds": 12.0,
            "saveCostSeconds": 0.05,
            "secondsBetweenFailures": 600.0,
            "failures": 2,
            "expectedLostSeconds": 6.0,
        }
    }


def test_a_report_is_refused_for_another_run_or_attempt_or_a_checkpoint_elsewhere():
    checkpoint = CommittedCheckpoint("s3://bkt/demo/step-00000010", 10, "2026-11-24T00:00:00Z")
    report = Report("ns", "demo", "u", 2, last_good_checkpoint=checkpoint)
    assert report.refusal("ns", "demo", "u", 2, "s3://bkt/demo") is None
    assert "not this run" in report.refusal("ns", "demo", "other-uid", 2, "s3://bkt/demo")
    assert "current attempt is 3" in report.refusal("ns", "demo", "u", 3, "s3://bkt/demo")
    assert "not the step-00000010 directory" in report.refusal("ns", "demo", "u", 2, "s3://attacker/demo")
    report.last_good_checkpoint = CommittedCheckpoint("s3://bkt/demo/step-00000010", 11, "2026-11-24T00:00:00Z")
    assert report.refusal("ns", "demo", "u", 2, "s3://bkt/demo")
    with pytest.raises(progress_report.ReportError, match="larger than"):
        Report.from_json(b"x" * (progress_report.MAX_REPORT_BYTES + 1))


def test_a_report_sets_status_fields_the_status_model_has_under_the_same_names():
    """The contract's wire names and the typed status model (which generates the CRD's status schema) agree, both
    ways: a full report validates strictly and dumps back unchanged, and the model has no progress or checkpoint
    field a report cannot set."""
    from trainingrun_operator import api_status

    report = Report(
        "team-a",
        "demo",
        "uid-1",
        2,
        progress=Progress(
            step=7,
            updated_at="2026-11-24T00:00:00Z",
            total_steps=10,
            loss=1.5,
            samples_per_second=320.0,
            productive_seconds=12.5,
        ),
        last_good_checkpoint=CommittedCheckpoint("s3://b/run/step-00000005", 5, "2026-11-24T00:00:00Z", "0" * 64),
    )
    fields = report.status_fields()
    status = api_status.TrainingRunStatus.model_validate(fields)  # extra="forbid": an unknown name fails here
    assert status.model_dump(by_alias=True, exclude_none=True, include={"progress", "last_good_checkpoint"}) == fields
    assert {f.alias for f in Progress.model_fields.values()} | set(api_status.DERIVED_PROGRESS_FIELDS) == {
        f.alias or n for n, f in api_status.Progress.model_fields.items()
    }
    assert {f.alias for f in CommittedCheckpoint.model_fields.values()} == {
        f.alias or n for n, f in api_status.CheckpointRef.model_fields.items()
    }


@pytest.mark.parametrize("refusals, sent", [(3, 1), (4, 0)])
def test_a_503_is_sent_again_at_once_on_a_new_connection(refusals, sent):
    """A standby operator replica answers 503; the operator's Service may route another connection to the
    replica that acts, so the report is sent again at once, on a new connection, up to SENDS_ON_503 times."""
    from trainingrun_trainer.reporting import SENDS_ON_503

    answers = [503] * refusals + [200]
    connections = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            connections.append(self.client_address)
            self.send_response(answers.pop(0))
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    reporter = ProgressReporter(None, IDENTITY)  # no thread of its own: the one report below is this test's
    reporter.endpoint = ReportEndpoint(f"http://127.0.0.1:{server.server_address[1]}{contract.REPORT_PATH}", None, None)
    reporter._send(reporter._report())
    server.shutdown()
    assert len(connections) == min(refusals + 1, SENDS_ON_503) == len(set(connections))
    assert (reporter.sent, reporter.failures) == (sent, 1 - sent)


def test_a_hang_is_sent_at_once_from_any_rank_and_goes_into_status(endpoint, tmp_path):
    url, received, wait_until = endpoint
    token = tmp_path / "token"
    token.write_text(TOKEN)
    hang = progress_report.Hang(
        step=40, time="2026-11-24T00:00:00Z", diagnosis="hang after step 40: ... waited for rank 1", ranks=[1]
    )
    report = Report("team-a", "demo", "uid-1", 2, last_hang=hang)
    env = {contract.REPORT_URL: url, contract.REPORT_TOKEN_FILE: str(token)}
    assert reporting.send_now(report, env=env)  # sent before it returns: the process exits next
    assert received[-1][2].last_hang == hang
    assert Report.from_json(report.to_json()).status_fields() == {"lastHang": hang.to_wire()}
    assert not reporting.send_now(report, env={})  # no endpoint: nothing to send to


def test_a_slow_rank_goes_into_status_and_says_who_in_words():
    slow = progress_report.SlowRank(
        rank=1, pod="demo-a1-worker-0", ratio=3.0, seconds=0.3, median_seconds=0.1, factor=1.5, step=7
    )
    report = Report("team-a", "demo", "uid-1", 2, slow_rank=slow)
    assert Report.from_json(report.to_json()).status_fields() == {"slowRank": slow.to_wire()}
    assert slow.words().startswith("rank 1 (pod demo-a1-worker-0) takes 3x the other ranks' time")
    none = progress_report.SlowRank(ratio=1.0, seconds=0.1, median_seconds=0.1, factor=1.5, step=9)
    assert none.words() == "no rank is 1.5x slower than the others any more (since step 9)"
    body = json.loads(report.to_json())
    body["slowRank"]["ratio"] = float("inf")
    with pytest.raises(progress_report.ReportError, match=r"slowRank\.ratio"):
        Report.from_json(json.dumps(body).encode())


@pytest.mark.parametrize("diagnosis", ["x" * (progress_report.MAX_DIAGNOSIS_LENGTH + 1), "rank 1 at caf\u00e9.py", ""])
def test_a_hang_diagnosis_that_is_too_long_or_not_ascii_is_refused(diagnosis):
    body = {
        "namespace": "ns",
        "name": "demo",
        "uid": "u",
        "attempt": 1,
        "lastHang": {"step": 1, "time": "2026-11-24T00:00:00Z", "diagnosis": diagnosis},
    }
    with pytest.raises(progress_report.ReportError, match=r"lastHang\.diagnosis"):
        Report.from_json(json.dumps(body).encode())
