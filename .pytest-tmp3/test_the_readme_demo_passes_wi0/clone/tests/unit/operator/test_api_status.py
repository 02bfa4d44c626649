"""api_status: the status parts generated from the report's models keep each field's name and description and make
every field optional (status may hold what an older trainer reported), plus the operator's own derived fields; the
status round-trips through its wire form as the operator writes it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainingrun_api import progress_report
from trainingrun_operator import api_status
from trainingrun_operator.api_status import DERIVED_PROGRESS_FIELDS, TrainingRunStatus


def test_a_generated_part_has_every_report_field_optional_with_its_description_and_the_derived_ones():
    fields = api_status.Progress.model_fields
    for name, info in progress_report.Progress.model_fields.items():
        assert name in fields and fields[name].description == info.description
        assert not fields[name].is_required()
    wire = {fields[name].alias for name in fields} - {
        info.alias for info in progress_report.Progress.model_fields.values()
    }
    assert wire == set(DERIVED_PROGRESS_FIELDS)
    assert api_status.Progress.from_wire({}).to_wire() == {}  # an older trainer's report may hold none of them


def test_status_round_trips_as_the_operator_writes_it():
    wire = {
        "phase": "Running",
        "attempt": 2,
        "progress": {"step": 10, "updatedAt": "2026-12-01T10:00:00Z", "percent": 1.0},
        "lastGoodCheckpoint": {"uri": "s3://bkt/r/step-00000010", "step": 10, "time": "2026-12-01T10:00:00Z"},
        "restarts": {"failures": 1, "preemptions": 0, "total": 1, "inPlace": 3, "backoffSeconds": 0.0},
        "conditions": [{"type": "Ready", "status": "True"}],
    }
    status = TrainingRunStatus.from_wire(wire)
    assert status.progress.step == 10 and status.restarts.failures == 1
    for key, value in wire.items():
        assert status.to_wire()[key] == value


@pytest.mark.parametrize("wire", [{"phase": "Crashed"}, {"conditions": [{"type": "Ready", "status": "Yes"}]}])
def test_a_phase_or_condition_status_outside_the_api_is_refused(wire):
    with pytest.raises(ValidationError):
        TrainingRunStatus.from_wire(wire)
