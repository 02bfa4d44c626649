"""The operator's report endpoint, in process (the real-API tier tests it with real tokens and pods)."""
import asyncio
from datetime import datetime, timezone

import pytest
from aiohttp.test_utils import make_mocked_request

from trainingrun_operator import reports


class NeverAsked:
    async def caller(self, token):
        raise AssertionError("a standby replica must not review tokens: it answers before")


def test_a_standby_replica_answers_503_and_writes_nothing():
    written = []

    async def accept(key, fields):
        written.append(key)

    endpoint = reports.ReportEndpoint(NeverAsked(), view=lambda namespace, name: None, accept=accept,
                                      clock=lambda: datetime.now(timezone.utc), acting=lambda: False)
    request = make_mocked_request("POST", "/v1/reports", headers={"Authorization": "Bearer t"})
    response = asyncio.run(endpoint.handle(request))
    assert response.status == 503 and b"stands by" in response.body and written == []


def test_report_fields_are_read_through_the_status_model():
    from trainingrun_trainer.contract import CommittedCheckpoint, Progress, Report

    report = Report("ns", "demo", "u", 1, progress=Progress(step=3, updated_at="2026-11-25T00:00:00Z", loss=1),
                    last_good_checkpoint=CommittedCheckpoint("s3://b/demo/step-00000003", 3, "2026-11-25T00:00:00Z"))
    assert reports.status_fields(report) == {
        "progress": {"step": 3, "updatedAt": "2026-11-25T00:00:00Z", "loss": 1.0},
        "lastGoodCheckpoint": {"uri": "s3://b/demo/step-00000003", "step": 3, "time": "2026-11-25T00:00:00Z"}}


def test_a_report_field_the_status_model_lacks_is_refused(monkeypatch):
    from trainingrun_trainer.contract import Progress, Report

    report = Report("ns", "demo", "u", 1, progress=Progress(step=3, updated_at="2026-11-25T00:00:00Z"))
    monkeypatch.setattr(Report, "status_fields", lambda self: {"progress": {"step": 3, "stepz": 4}})
    with pytest.raises(reports.Refused) as refused:
        reports.status_fields(report)
    assert refused.value.code == 400 and "status" in str(refused.value)


def test_a_report_cannot_set_what_the_operator_derives():
    from trainingrun_trainer import contract

    body = ('{"namespace": "ns", "name": "demo", "uid": "u", "attempt": 1, "progress": {"step": 3, '
            '"updatedAt": "2026-11-25T00:00:00Z", "percent": 99}}')
    report = contract.Report.from_json(body.encode())  # fields the contract does not name are dropped
    assert "percent" not in reports.status_fields(report)["progress"]
