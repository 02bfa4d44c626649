"""The operator's report endpoint, in process (the real-API tier tests it with real tokens and pods)."""

import asyncio
import json
from datetime import datetime, timezone

import pytest
from aiohttp.test_utils import make_mocked_request

from trainingrun_api import progress_report
from trainingrun_operator import reports


class NeverAsked:
    async def caller(self, token):
        raise AssertionError("a standby replica must not review tokens: it answers before")


def test_a_standby_replica_answers_503_and_writes_nothing():
    written = []

    async def accept(key, fields, at_once=False):
        written.append(key)

    endpoint = reports.ReportEndpoint(
        NeverAsked(),
        view=lambda namespace, name: None,
        accept=accept,
        clock=lambda: datetime.now(timezone.utc),
        acting=lambda: False,
    )
    request = make_mocked_request("POST", "/v1/reports", headers={"Authorization": "Bearer t"})
    response = asyncio.run(endpoint.handle(request))
    assert response.status == 503 and b"stands by" in response.body and written == []


def test_report_fields_are_read_through_the_status_model():
    from trainingrun_api.progress_report import CommittedCheckpoint, Progress, Report

    report = Report(
        "ns",
        "demo",
        "u",
        1,
        progress=Progress(step=3, updated_at="2026-11-25T00:00:00Z", loss=1),
        last_good_checkpoint=CommittedCheckpoint("s3://b/demo/step-00000003", 3, "2026-11-25T00:00:00Z"),
    )
    assert report.status_fields() == {
        "progress": {"step": 3, "updatedAt": "2026-11-25T00:00:00Z", "loss": 1.0},
        "lastGoodCheckpoint": {"uri": "s3://b/demo/step-00000003", "step": 3, "time": "2026-11-25T00:00:00Z"},
    }


def test_the_newest_checkpoint_in_memory_is_read_into_status_beside_the_one_in_storage():
    from trainingrun_api.progress_report import CheckpointInMemory, CommittedCheckpoint, Report

    report = Report(
        "ns",
        "demo",
        "u",
        1,
        last_good_checkpoint=CommittedCheckpoint("s3://b/demo/step-00000030", 30, "2026-11-25T00:00:00Z"),
        checkpoint_in_memory=CheckpointInMemory(50, "2026-11-25T00:00:09Z"),
    )
    fields = Report.from_json(report.to_json()).status_fields()
    assert fields["checkpointInMemory"] == {"step": 50, "time": "2026-11-25T00:00:09Z"}
    assert fields["lastGoodCheckpoint"]["step"] == 30
    reports.no_later_than_now(fields, datetime(2026, 11, 25, 0, 0, 5, tzinfo=timezone.utc))
    assert fields["checkpointInMemory"]["time"] == "2026-11-25T00:00:05Z"  # a pod's clock ahead of the operator's


def test_the_pods_short_of_memory_are_read_into_status_and_a_report_naming_too_many_or_odd_names_is_refused():
    from trainingrun_api.progress_report import MAX_PODS_NAMED, MemoryShort, Report, ReportError

    report = Report("ns", "demo", "u", 1, checkpoint_memory_short=MemoryShort(["demo-a1-worker-1"], 40))
    fields = Report.from_json(report.to_json()).status_fields()
    assert fields["checkpointMemoryShort"] == {"pods": ["demo-a1-worker-1"], "step": 40}
    fitting = Report.from_json(Report("ns", "demo", "u", 1, checkpoint_memory_short=MemoryShort([], 50)).to_json())
    assert fitting.status_fields()["checkpointMemoryShort"] == {"pods": [], "step": 50}  # fits again
    head = '{"namespace": "ns", "name": "demo", "uid": "u", "attempt": 1, "checkpointMemoryShort": '
    too_many = json.dumps({"pods": [f"p{i}" for i in range(MAX_PODS_NAMED + 1)], "step": 1})
    for body in (too_many, '{"pods": ["w\\u00e9"], "step": 1}', '{"pods": "w", "step": 1}'):
        with pytest.raises(ReportError, match="checkpointMemoryShort.pods"):
            Report.from_json((head + body + "}").encode())


def test_the_status_parts_are_generated_from_the_report_parts():
    """One source: a field a report part gains is in the status model (and so in the CRD's status schema) too."""
    from pydantic import Field

    from trainingrun_api.progress_report import Progress
    from trainingrun_operator import api_status

    class Newer(Progress):
        tokens_per_second: float | None = Field(default=None, description="Tokens over all ranks.")

    status = api_status.status_part(Newer, "NewerProgress")
    assert status.model_fields["tokens_per_second"].description == "Tokens over all ranks."
    assert not status.model_fields["step"].is_required()  # status may hold what an older trainer reported
    assert status.from_wire({"tokensPerSecond": 2.5}).tokens_per_second == 2.5


def test_a_report_cannot_set_what_the_operator_derives():

    body = (
        '{"namespace": "ns", "name": "demo", "uid": "u", "attempt": 1, "progress": {"step": 3, '
        '"updatedAt": "2026-11-25T00:00:00Z", "percent": 99}}'
    )
    report = progress_report.Report.from_json(body.encode())  # fields the contract does not name are dropped
    assert "percent" not in report.status_fields()["progress"]


def process_time(process):
    from trainingrun_api.progress_report import ProcessTime

    return ProcessTime(process, 10.0, 5.0, 1.0, 0.0, 0.0, 4.0, 0.0, 100.0)


@pytest.mark.parametrize(
    "process,with_progress,at_once",
    [
        ("worker-0/202/t1", True, True),  # a restarted process's first step: the run trains again
        ("worker-0/101/t0", True, False),  # the process status already shows
        ("worker-0/202/t1", False, False),  # a new process that has not stepped yet
    ],
)
def test_a_new_process_s_first_step_is_written_at_once(process, with_progress, at_once):
    from trainingrun_api.progress_report import Progress, Report

    status = {"processTime": {"current": {"process": "worker-0/101/t0"}}}
    progress = Progress(step=101, updated_at="2026-11-27T00:00:00Z") if with_progress else None
    report = Report("ns", "demo", "u", 1, progress=progress, process_time=process_time(process))
    assert reports.trains_again(report, status) is at_once


@pytest.mark.slow
def test_a_write_at_once_goes_ahead_of_the_wait_once_per_period_and_takes_what_waited():
    now = [0.0]
    written = []

    async def write(key, fields):
        written.append((now[0], fields))

    async def scenario():
        writes = reports.CoalescedWrites(write, seconds=3, clock=lambda: now[0])
        key = ("ns", "demo")
        await writes.submit(key, {"lastReportTime": "a"})
        now[0] = 1.0
        await writes.submit(key, {"lastGoodCheckpoint": {"step": 100}})  # waits for t=3
        now[0] = 1.5
        await writes.submit(key, {"progress": {"step": 101}}, at_once=True)  # the run trains again
        assert written[-1] == (1.5, {"lastGoodCheckpoint": {"step": 100}, "progress": {"step": 101}})
        assert not writes.pending
        now[0] = 2.0
        await writes.submit(key, {"progress": {"step": 102}}, at_once=True)  # a second claim within the period waits
        assert len(written) == 2 and writes.pending[key] == {"progress": {"step": 102}}
        await asyncio.wait_for(asyncio.gather(*writes.flushing.values()), 10)
        assert [fields for _, fields in written] == [
            {"lastReportTime": "a"},
            {"lastGoodCheckpoint": {"step": 100}, "progress": {"step": 101}},
            {"progress": {"step": 102}},
        ]

    asyncio.run(scenario())


class OnePod:
    """A reviewer that knows one token: the pod demo-a1-worker-0 of run demo's attempt 1."""

    async def caller(self, token, source=""):
        from trainingrun_operator.report_callers import Caller

        return Caller("ns", "trainers", "demo-a1-worker-0", "pod-uid") if token == "t" else None


def run_view(status):
    pod = {
        "metadata": {
            "name": "demo-a1-worker-0",
            "uid": "pod-uid",
            "labels": {"trainingrun.dev/attempt": "1"},
            "ownerReferences": [{"controller": True, "uid": "job-uid"}],
        }
    }
    return reports.RunView("u", 1, "demo-a1", "s3://b/demo", status, [pod], frozenset({"job-uid"}))


def test_a_new_step_alone_waits_for_the_heartbeat_and_news_goes_at_once():
    """A run's status is written per heartbeat while only its step moves, and at once for what a restart or the user
    needs now: the first step, a committed checkpoint, the last step."""
    from trainingrun_api.progress_report import CheckpointInMemory, CommittedCheckpoint, Progress, Report

    now = [datetime(2026, 11, 25, 0, 0, 0, tzinfo=timezone.utc)]
    status: dict = {}
    written = []

    async def accept(key, fields, at_once=False):
        written.append(sorted(fields))
        status.update(fields)  # as the index shows the write

    endpoint = reports.ReportEndpoint(
        OnePod(), view=lambda ns, name: run_view(status), accept=accept, clock=lambda: now[0]
    )

    def report(seconds, step, **more):
        now[0] = datetime(2026, 11, 25, 0, 0, seconds, tzinfo=timezone.utc)
        at = f"2026-11-25T00:00:{seconds:02d}Z"
        body = Report("ns", "demo", "u", 1, progress=Progress(step, at, total_steps=100), **more).to_json()
        request = make_mocked_request("POST", "/v1/reports", headers={"Authorization": "Bearer t"})
        request._read_bytes = body
        before = len(written)
        assert asyncio.run(endpoint.handle(request)).status == 200
        return len(written) > before

    assert report(0, 1)  # the first step
    assert not report(10, 11)  # a new step alone: with the heartbeat
    assert not report(20, 21, checkpoint_in_memory=CheckpointInMemory(20, "2026-11-25T00:00:20Z"))
    assert report(30, 31) and status["progress"]["step"] == 31  # the heartbeat, with the newest step
    assert report(
        31, 32, last_good_checkpoint=CommittedCheckpoint("s3://b/demo/step-00000030", 30, "2026-11-25T00:00:30Z")
    )
    assert not report(40, 42)
    assert report(41, 43, process_time=process_time("worker-0/202/t1"))  # a restarted process's first step
    assert not report(44, 44, process_time=process_time("worker-0/202/t1"))
    assert report(45, 100)  # the last step
    assert status["progress"]["step"] == 100 and status["progress"]["percent"] == 100.0
    assert written[0] == ["lastReportTime", "progress"]


@pytest.mark.parametrize(
    "fields,status,news",
    [
        ({"progress": {"step": 5}}, {}, True),  # the first step
        ({"progress": {"step": 6}}, {"progress": {"step": 5}}, False),
        ({"progress": {"step": 10, "totalSteps": 10}}, {"progress": {"step": 9, "totalSteps": 10}}, True),
        ({"progress": {"step": 10, "totalSteps": 10}}, {"progress": {"step": 10, "totalSteps": 10}}, False),
        ({"checkpointInMemory": {"step": 6}}, {"checkpointInMemory": {"step": 5}}, False),
        ({"lastGoodCheckpoint": {"step": 6}}, {"lastGoodCheckpoint": {"step": 5}}, True),
        ({"lastGoodCheckpoint": {"step": 5}, "timeBreakdown": {"a": 1}}, {"lastGoodCheckpoint": {"step": 5}}, False),
    ],
)
def test_what_is_news_to_status(fields, status, news):
    assert reports.news(fields, status) is news
