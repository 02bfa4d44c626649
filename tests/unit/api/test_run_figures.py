"""run_figures: percent done and the completion estimate from the step rate between two reports, goodput's one
definition, and the wall-time breakdown whose parts add up to the wall time."""

from __future__ import annotations

import math

import pytest

from trainingrun_api.progress_report import ProcessTime
from trainingrun_api.run_figures import BREAKDOWN, goodput, time_breakdown, with_estimates


def progress(step, updated, total=1000, **more):
    return {"step": step, "totalSteps": total, "updatedAt": updated, **more}


def test_the_estimate_comes_from_the_rate_between_reports():
    before = progress(100, "2026-12-01T10:00:00Z")
    now = with_estimates(before, progress(200, "2026-12-01T10:01:40Z"))  # 100 steps in 100 s: 800 s to go
    assert now["percent"] == 20.0
    assert now["estimatedCompletionTime"] == "2026-12-01T10:15:00Z"


def test_a_report_without_a_rate_keeps_the_estimate_while_the_step_stands_and_drops_it_after_a_resume_below():
    before = progress(200, "2026-12-01T10:01:40Z", estimatedCompletionTime="2026-12-01T10:15:00Z")
    same = with_estimates(before, progress(200, "2026-12-01T10:02:00Z"))
    assert same["estimatedCompletionTime"] == "2026-12-01T10:15:00Z"
    resumed = with_estimates(before, progress(150, "2026-12-01T10:03:00Z"))
    assert "estimatedCompletionTime" in resumed and resumed["estimatedCompletionTime"] is None  # removed by the patch
    assert "estimatedCompletionTime" not in with_estimates(None, progress(10, "2026-12-01T10:00:00Z"))


def test_a_finished_run_completes_at_its_last_report_and_percent_stops_at_100():
    done = with_estimates(None, progress(1200, "2026-12-01T11:00:00Z"))
    assert (done["percent"], done["estimatedCompletionTime"]) == (100.0, "2026-12-01T11:00:00Z")


def test_an_estimate_past_a_century_is_none_rather_than_an_overflow():
    before = progress(1, "2026-12-01T10:00:00Z", total=2**63 - 1)
    assert (
        with_estimates(before, progress(2, "2026-12-01T10:00:01Z", total=2**63 - 1))["estimatedCompletionTime"] is None
    )


def test_progress_without_a_total_is_returned_as_it_is():
    assert with_estimates(None, {"step": 5}) == {"step": 5}


@pytest.mark.parametrize(
    "productive, wall, expected", [(50.0, 100.0, 0.5), (150.0, 100.0, 1.0), (-5.0, 100.0, 0.0), (1.0, 0.0, None)]
)
def test_goodput_is_bounded_and_undefined_before_any_wall_time(productive, wall, expected):
    assert goodput(productive, wall) == expected


def test_the_breakdown_adds_up_to_the_wall_time_and_splits_kept_from_lost_compute():
    first = ProcessTime(
        process="a", alive_seconds=60, startup_seconds=10, compute_seconds=40, checkpoint_seconds=3, data_wait_seconds=2
    )
    second = ProcessTime(
        process="b",
        alive_seconds=30,
        startup_seconds=5,
        restore_seconds=2,
        compute_seconds=20,
        restored_productive_seconds=30,
    )
    parts = time_breakdown(100.0, [first, second], productive_seconds=50.0, backoff_seconds=4.0)
    assert list(parts) == list(BREAKDOWN)
    assert math.isclose(sum(parts.values()), 100.0)
    assert parts["productive"] == 50.0 and parts["lost"] == 10.0  # 60 s of compute, 50 kept
    assert parts["startup"] == 15 + (100 - 4 - 90)


def test_a_hung_process_s_wait_is_the_breakdowns_hang_not_startup():
    hung = ProcessTime(process="a", alive_seconds=70, startup_seconds=5, compute_seconds=30, hang_seconds=35)
    parts = time_breakdown(80.0, [hung], productive_seconds=30.0)
    assert parts["hang"] == 35 and parts["startup"] == 5 + (80 - 70)
    assert math.isclose(sum(parts.values()), 80.0) and parts["other"] == 0
