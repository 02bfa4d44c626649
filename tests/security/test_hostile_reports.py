"""What a pod of a run can send the operator's report endpoint, and that none of it breaks the parser, moves a run's
resume floor to a checkpoint that is not one, or silences the stall watchdog.

The endpoint runs as an aiohttp server on loopback; the TokenReview is replaced by a caller that is a pod of the run
(the real-API tier reviews real tokens: tests/real_api/test_reports_real.py), so every case below is a report from a
pod the operator trusts to speak for the run.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta, timezone

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given
from hypothesis import strategies as st

from trainingrun_api import contract, nesting, progress_report, run_figures
from trainingrun_operator import naming, report_callers, reports

NOW = datetime(2026, 11, 26, 12, 0, tzinfo=timezone.utc)
RUN_URI = "s3://bucket/demo"


class PodOfTheRun:
    async def caller(self, token, source=None):
        return report_callers.Caller("ns", "trainers", "demo-a1-worker-0", "pod-uid")


def view(namespace, name):
    pod = {
        "metadata": {
            "name": "demo-a1-worker-0",
            "uid": "pod-uid",
            "labels": {naming.LABEL_ATTEMPT: "1"},
            "ownerReferences": [{"uid": "job-uid", "controller": True}],
        }
    }
    return reports.RunView(
        uid="run-uid",
        attempt=1,
        job_name="demo-a1",
        checkpoint_uri=RUN_URI,
        status={},
        pods=[pod],
        pod_controllers=frozenset({"job-uid"}),
        stall_timeout_seconds=600,
    )


@pytest_asyncio.fixture
async def endpoint():
    written: list = []

    async def accept(key, fields, at_once=False):
        written.append(fields)

    app = reports.ReportEndpoint(PodOfTheRun(), view=view, accept=accept, clock=lambda: NOW).app()
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:

        async def post(body):
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = await client.post(contract.REPORT_PATH, data=raw, headers={"Authorization": "Bearer t"})
            return response.status, (await response.json())["message"]

        post.written = written
        yield post


def report(**fields):
    return {"namespace": "ns", "name": "demo", "uid": "run-uid", "attempt": 1, **fields}


def progress(step=5, updated_at="2026-11-26T11:59:00Z"):
    return {"step": step, "updatedAt": updated_at, "loss": 1.0}


@pytest.mark.asyncio
async def test_json_nested_thousands_deep_is_a_400_that_says_so(endpoint):
    """On main: RecursionError, a 500 and a traceback in the operator's log."""
    for depth in (50, 20_000):
        body = b'{"namespace": "ns", "x": ' + b"[" * depth + b"]" * depth + b"}"
        status, message = await endpoint(body)
        assert status == 400 and "nests deeper than" in message
    assert endpoint.written == []


def test_brackets_inside_strings_are_not_nesting():
    assert nesting.text_depth(b'{"a": "[[[[[[[[\\"{{{{", "b": [1]}') == 2


@pytest.mark.parametrize(
    "uri",
    [
        f"{RUN_URI}/step-\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668",  # Arabic-Indic digits: int() reads 12345678
        f"{RUN_URI}/step-00000005\n",
        f"{RUN_URI}/step-\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff15",  # fullwidth digits
    ],
)
@pytest.mark.asyncio
async def test_a_checkpoint_named_with_anything_but_ascii_digits_never_becomes_the_resume_floor(endpoint, uri):
    body = report(
        lastGoodCheckpoint={"uri": uri, "step": 12345678 if "\u0661" in uri else 5, "time": "2026-11-26T11:59:00Z"}
    )
    status, _ = await endpoint(body)
    assert status in (400, 403)
    assert endpoint.written == []


@pytest.mark.parametrize(
    "field, value",
    [
        ("updatedAt", "2026-11-26T11:59:00Z\n"),
        ("updatedAt", "\u0662\u0660\u0662\u0666-11-26T11:59:00Z"),
        ("updatedAt", "2026-13-45T11:59:00Z"),  # the shape of a time, not a time
    ],
)
@pytest.mark.asyncio
async def test_times_must_be_ascii_rfc3339_matched_whole(endpoint, field, value):
    status, message = await endpoint(report(progress={**progress(), field: value}))
    assert status == 400 and "progress.updatedAt must be an RFC 3339 time" in message


@pytest.mark.asyncio
async def test_a_sha256_with_a_trailing_newline_is_refused(endpoint):
    checkpoint = {
        "uri": f"{RUN_URI}/step-00000005",
        "step": 5,
        "time": "2026-11-26T11:59:00Z",
        "sha256": "a" * 64 + "\n",
    }
    status, message = await endpoint(report(lastGoodCheckpoint=checkpoint))
    assert status == 400 and "64 lowercase hex digits" in message


@pytest.mark.asyncio
async def test_names_in_a_report_are_printable_ascii(endpoint):
    status, message = await endpoint({**report(), "name": "demo\u200b"})
    assert status == 400 and "printable ASCII" in message


@pytest.mark.asyncio
async def test_a_time_in_the_future_is_taken_as_now(endpoint):
    """On main, an updatedAt in 2099 kept the stall watchdog from ever firing."""
    future = "2099-01-01T00:00:00Z"
    checkpoint = {"uri": f"{RUN_URI}/step-00000005", "step": 5, "time": future}
    status, _ = await endpoint(report(progress=progress(updated_at=future), lastGoodCheckpoint=checkpoint))
    assert status == 200
    fields = endpoint.written[-1]
    assert fields["progress"]["updatedAt"] == contract.rfc3339(NOW)
    assert fields["lastGoodCheckpoint"]["time"] == contract.rfc3339(NOW)


@pytest.mark.asyncio
async def test_a_time_in_the_past_is_kept(endpoint):
    earlier = contract.rfc3339(NOW - timedelta(minutes=1))
    status, _ = await endpoint(report(progress=progress(updated_at=earlier)))
    assert status == 200 and endpoint.written[-1]["progress"]["updatedAt"] == earlier


@pytest.mark.asyncio
async def test_a_report_in_utf16_is_refused_before_its_nesting_could_hide(endpoint):
    """json.loads reads UTF-16 by itself, but the nesting scan reads bytes: U+2022's 0x22 byte put the scan inside a
    string, so on main a 901-deep report in UTF-16-LE was parsed (and accepted)."""
    text = '{"namespace": "ns", "name": "demo", "uid": "run-uid", "attempt": 1, "note": "\u2022", "x": '
    body = (text + "[" * 901 + "]" * 901 + "}").encode("utf-16-le")
    assert nesting.text_depth(body) <= progress_report.MAX_REPORT_DEPTH  # the scan alone is fooled
    status, message = await endpoint(body)
    assert (status, message) == (400, "the report is not UTF-8 JSON")
    assert endpoint.written == []


@given(
    before=st.integers(0, 2**63 - 2),
    ahead=st.integers(1, 2**63 - 1),
    total=st.integers(1, 2**63 - 1),
    seconds=st.floats(1e-6, 1e9),
)
def test_no_progress_the_report_model_admits_crashes_the_estimates(before, ahead, total, seconds):
    """On main totalSteps near 2**63 made the ETA raise OverflowError: a 500 per report."""
    step = min(before + ahead, 2**63 - 1)
    then = datetime(2026, 11, 26, 12, 0, tzinfo=timezone.utc)
    previous = {"step": before, "updatedAt": contract.rfc3339(then)}
    now = contract.rfc3339(then + timedelta(seconds=seconds))
    estimated = run_figures.with_estimates(previous, {"step": step, "totalSteps": total, "updatedAt": now})
    eta = estimated.get("estimatedCompletionTime")
    assert eta is None or contract.parse_time(eta) >= contract.parse_time(now)
    assert 0 <= estimated["percent"] <= 100


@pytest.mark.asyncio
async def test_a_bearer_token_with_a_byte_that_is_not_utf8_is_a_401_without_a_traceback(caplog):
    """aiohttp hands such a header over with surrogates; on main `TokenReviewer.caller` raised UnicodeEncodeError
    before any rate limit: a 500 and a logged traceback per request, with no credentials at all."""

    class NoApi:
        async def request(self, *args, **kwargs):
            raise AssertionError("a junk token must cost no TokenReview")

    reviewer = report_callers.TokenReviewer(lambda: NoApi(), 60.0)

    async def accept(key, fields, at_once=False):
        raise AssertionError("nothing is accepted")

    app = reports.ReportEndpoint(reviewer, view=view, accept=accept, clock=lambda: NOW).app()
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        body = json.dumps(report()).encode()
        writer.write(
            b"POST " + contract.REPORT_PATH.encode() + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ab\xffcd\r\n"
            b"Content-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    finally:
        await server.close()
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
    assert reviewer.refused_unreviewed == 1
    assert not [r for r in caplog.records if r.levelname == "ERROR" or r.exc_info]
