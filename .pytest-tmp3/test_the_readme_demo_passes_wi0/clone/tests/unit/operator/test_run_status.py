"""run_status: conditions (one per type, a transition time that moves only with the status), goodput as a function
of status alone, and SpecRejected when the checkpoint uri changes after the start."""

from trainingrun_operator import run_status, validation


def test_a_condition_keeps_its_transition_time_until_its_status_flips():
    conditions = run_status.Conditions([], "2026-12-01T10:00:00Z", generation=3)
    assert not conditions.set("Stalled", False, "Reporting")  # never True: no False entry
    assert conditions.as_list() == [] and not conditions.changed
    assert conditions.set("Stalled", True, "NoReports", "no report for 10 minutes")
    later = run_status.Conditions(conditions.as_list(), "2026-12-01T10:05:00Z", generation=3)
    assert not later.set("Stalled", True, "NoReports", "no report for 15 minutes")  # no flip: no Event
    (stalled,) = later.as_list()
    assert stalled["lastTransitionTime"] == "2026-12-01T10:00:00Z" and stalled["message"].endswith("15 minutes")
    assert later.changed and stalled["observedGeneration"] == 3
    assert later.set("Stalled", False, "Reporting")
    assert later.as_list()[0]["lastTransitionTime"] == "2026-12-01T10:05:00Z"


def test_setting_a_condition_to_what_it_is_changes_nothing():
    first = run_status.Conditions([], "2026-12-01T10:00:00Z", generation=None)
    first.set("Ready", True, "Running")
    again = run_status.Conditions(first.as_list(), "2026-12-01T11:00:00Z", generation=None)
    again.set("Ready", True, "Running")
    assert not again.changed and "observedGeneration" not in again.as_list()[0]


def test_goodput_is_measured_to_the_reports_time_not_to_now():
    status = {
        "startTime": "2026-12-01T10:00:00Z",
        "progress": {"updatedAt": "2026-12-01T10:10:00Z", "productiveSeconds": 450.0},
    }
    assert run_status.goodput(status) == 0.75
    assert run_status.goodput({"startTime": "2026-12-01T10:00:00Z", "progress": {}}) is None  # nothing reported
    assert run_status.goodput({"progress": status["progress"]}) is None  # not started


def test_changing_the_checkpoint_uri_after_the_start_is_refused_and_setting_it_back_clears_that(minimal_body):
    run = validation.parse(minimal_body)
    started = run.spec.checkpoint.uri
    conditions = run_status.Conditions([], "2026-12-01T10:00:00Z", generation=1)
    moved = validation.parse({**minimal_body, "spec": {"checkpoint": {"uri": "s3://other/runs/demo"}}})
    (note,) = run_status.spec_conditions(moved, {}, None, started, conditions)
    assert note.reason == "SpecRejected" and started in note.message
    assert conditions.is_true("SpecRejected")
    assert run_status.spec_conditions(run, {}, None, started, conditions) == []
    assert not conditions.is_true("SpecRejected")
