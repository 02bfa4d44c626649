"""local.status_server: the report endpoint of `trainingrun local` on 127.0.0.1 takes a run's reports with the
cluster endpoint's checks (token, size, run and attempt), and a client that is broken or slow on purpose can neither
hold it nor starve the run's own reports (a bounded wait for a request, a bounded number of connections)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest
from local_documents import BODY

from trainingrun_api import progress_report
from trainingrun_operator import local, validation
from trainingrun_operator.local import status_server
from trainingrun_operator.local.status_server import StatusServer


@pytest.fixture
def server(minimal_body, tmp_path, monkeypatch):
    monkeypatch.setattr(status_server, "REQUEST_SECONDS", 1.0)  # how long a request may take to arrive
    monkeypatch.setattr(status_server, "MAX_CONNECTIONS", 4)
    run = validation.parse(minimal_body)
    served = StatusServer(run, tmp_path / "report-token")
    served.new_attempt(1)
    yield served
    served.close()


def report(step: int = 3, attempt: int = 1) -> bytes:
    return progress_report.Report.model_validate(
        {
            "namespace": "team-a",
            "name": "demo",
            "uid": "3f1c2a9e-0000-4000-8000-000000000001",
            "attempt": attempt,
            "progress": {"step": step, "updatedAt": "2026-12-01T10:00:00Z"},
        }
    ).to_json()


def post(server: StatusServer, body: bytes, token: str | None = None, path: str | None = None) -> tuple[int, str]:
    url = server.url if path is None else server.url.replace(urlsplit(server.url).path, path)
    token = server.token_file.read_text() if token is None else token
    request = urllib.request.Request(url, body, {"Authorization": f"Bearer {token}"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.load(answer)["message"]
    except urllib.error.HTTPError as refused:
        return refused.code, json.load(refused)["message"]


def test_a_report_of_the_run_is_taken_into_its_status(server):
    assert post(server, report(step=7)) == (200, "ok")
    assert server.snapshot()["progress"]["step"] == 7 and server.report_count() == 1


def test_the_endpoint_checks_what_the_cluster_endpoint_checks(server):
    assert post(server, report(), token="not-the-token")[0] == 401
    assert post(server, report(), path="/elsewhere")[0] == 404
    assert post(server, report(attempt=2))[0] == 403  # another attempt
    assert post(server, b"{not json")[0] == 400
    assert post(server, b"x" * (progress_report.MAX_REPORT_BYTES + 1))[0] == 413
    assert server.report_count() == 0


def raw_request(server: StatusServer, head: bytes) -> socket.socket:
    address = urlsplit(server.url)
    connection = socket.create_connection((address.hostname, address.port), timeout=30)
    connection.sendall(head)
    return connection


def status_line(connection: socket.socket) -> bytes:
    with connection:
        return connection.makefile("rb").readline()


@pytest.mark.slow
@pytest.mark.parametrize("length", [b"-1", b"12abc", b"\xd9\xa1\xd9\xa2", b"1" * 40])
def test_a_content_length_that_is_not_a_plain_number_is_refused(server, length):
    head = b"POST " + urlsplit(server.url).path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: " + length
    token = server.token_file.read_text().encode()
    connection = raw_request(server, head + b"\r\nAuthorization: Bearer " + token + b"\r\n\r\n")
    assert status_line(connection).split()[1] in (b"400", b"413")


@pytest.mark.slow
def test_a_body_that_never_comes_is_answered_408_and_the_connection_closed(server):
    token = server.token_file.read_text().encode()
    head = (
        b"POST " + urlsplit(server.url).path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
        b"Authorization: Bearer " + token + b"\r\n\r\n"
    )
    connection = raw_request(server, head + b'{"namespace"')  # then nothing more
    assert status_line(connection).split()[1] == b"408"


@pytest.mark.slow
def test_a_connection_that_sends_nothing_is_closed_by_the_endpoint(server):
    with raw_request(server, b"POST /report HTTP/1.1\r\nHost: x") as idle:  # a head that never ends
        assert idle.makefile("rb").read() == b""  # closed by the endpoint (our side would time out after 30 s)


def test_connections_past_the_cap_are_refused_at_once_and_a_report_gets_in_once_they_go(server, monkeypatch):
    monkeypatch.setattr(status_server, "REQUEST_SECONDS", 30.0)  # the idle ones hold their slots throughout
    idle = [raw_request(server, b"") for _ in range(status_server.MAX_CONNECTIONS)]
    try:
        assert status_line(raw_request(server, b"")).split()[1] == b"503"
    finally:
        for connection in idle:
            connection.close()
    assert server.wait_until_no_connection(timeout=30)
    assert post(server, report(step=9)) == (200, "ok")
    assert server.snapshot()["progress"]["step"] == 9


def test_the_local_report_endpoint_checks_what_the_operator_checks(tmp_path):
    """Same protocol and checks as the operator's endpoint: the bearer token from the file, this run and
    attempt only, checkpoints only under the run's URI; status holds only what was accepted."""
    import json
    import urllib.error
    import urllib.request

    from trainingrun_api.progress_report import CommittedCheckpoint, Progress, Report

    path = tmp_path / "run.yaml"
    path.write_text(BODY)
    run = local.load_run(str(path), local.LocalOptions(runs_dir=str(tmp_path / "runs")))
    status = local.StatusServer(run, tmp_path / "token")
    status.new_attempt(2)
    meta, uri = run.metadata, run.spec.checkpoint.uri

    def post(report, token=None):
        request = urllib.request.Request(
            status.url,
            data=report.to_json(),
            method="POST",
            headers={"Authorization": f"Bearer {token or status.token_file.read_text()}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, ""
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())["message"]

    progress = Progress(5, "2026-11-24T00:00:00Z")
    try:
        assert post(Report(meta.namespace, meta.name, meta.uid, 2, progress=progress), token="guess")[0] == 401
        assert post(Report(meta.namespace, meta.name, meta.uid, 1, progress=progress))[0] == 403
        elsewhere = CommittedCheckpoint("s3://attacker/x/step-00000010", 10, "2026-11-24T00:00:00Z")
        code, message = post(Report(meta.namespace, meta.name, meta.uid, 2, last_good_checkpoint=elsewhere))
        assert code == 403 and "not the step-00000010 directory" in message
        assert status.snapshot() == {}
        good = CommittedCheckpoint(f"{uri}/step-00000010", 10, "2026-11-24T00:00:00Z")
        assert (
            post(Report(meta.namespace, meta.name, meta.uid, 2, progress=progress, last_good_checkpoint=good))[0] == 200
        )
        assert status.snapshot() == {
            "progress": {"step": 5, "updatedAt": "2026-11-24T00:00:00Z"},
            "lastGoodCheckpoint": {"uri": good.uri, "step": 10, "time": good.time},
        }
        # percent and the estimated completion time, as the operator adds them (the step rate between reports)
        for step, at in ((10, "00:00:10"), (20, "00:00:20")):
            report = Report(meta.namespace, meta.name, meta.uid, 2, progress=Progress(step, f"2026-11-24T{at}Z", 100))
            assert post(report)[0] == 200
        assert status.snapshot()["progress"] == {
            "step": 20,
            "updatedAt": "2026-11-24T00:00:20Z",
            "totalSteps": 100,
            "percent": 20.0,
            "estimatedCompletionTime": "2026-11-24T00:01:40Z",
        }
    finally:
        status.close()


@pytest.mark.parametrize("authorization", [b"Bearer \xff\xfe", "Bearer tök€n".encode(), b"\xc3\xa9"])
def test_a_non_ascii_authorization_header_is_a_401_not_a_traceback(server, authorization, capsys):
    """Issue 77 item 5: on main compare_digest got non-ASCII text and raised TypeError: a traceback and no answer."""
    body = report()
    head = (
        b"POST "
        + urlsplit(server.url).path.encode()
        + b" HTTP/1.1\r\nHost: x\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\nAuthorization: "
        + authorization
        + b"\r\n\r\n"
    )
    assert status_line(raw_request(server, head + body)).split()[1] == b"401"
    assert "Traceback" not in capsys.readouterr().err
    assert server.report_count() == 0
