"""What the operator and `trainingrun local` derive from reports, the same way: estimates, goodput, time."""

from trainingrun_api import progress_report, run_figures


def progress(step, at, total=1000, **more):
    return {"step": step, "updatedAt": f"2026-11-25T10:00:{at:02d}Z", "totalSteps": total, **more}


def test_percent_and_completion_time_come_from_the_step_rate_between_reports():
    first = run_figures.with_estimates(None, progress(100, 0))
    assert first["percent"] == 10.0 and "estimatedCompletionTime" not in first  # no rate yet
    second = run_figures.with_estimates(first, progress(110, 10))  # 1 step/s, 890 to go
    assert second["percent"] == 11.0 and second["estimatedCompletionTime"] == "2026-11-25T10:15:00Z"
    assert (
        run_figures.with_estimates(second, progress(110, 20))["estimatedCompletionTime"]
        == second["estimatedCompletionTime"]
    )  # a heartbeat keeps it: the status is not rewritten
    resumed = run_figures.with_estimates(second, progress(50, 30))  # a new attempt resumed below the last step
    assert resumed["estimatedCompletionTime"] is None  # removed, not left stale
    done = run_figures.with_estimates(second, progress(1000, 40))
    assert done["percent"] == 100.0 and done["estimatedCompletionTime"] == "2026-11-25T10:00:40Z"
    assert run_figures.with_estimates(None, {"step": 5, "updatedAt": "2026-11-25T10:00:00Z"}) == {
        "step": 5,
        "updatedAt": "2026-11-25T10:00:00Z",
    }  # no totalSteps: nothing to estimate


def process(
    name, alive, startup=1.0, restore=0.0, checkpoint=0.5, data_wait=0.25, compute=5.0, evaluation=0.0, restored=0.0
):
    return progress_report.ProcessTime(
        name, alive, startup, restore, checkpoint, data_wait, compute, evaluation, restored
    )


def test_the_time_breakdown_adds_up_to_wall_time_and_splits_compute_into_kept_and_lost():
    """Two processes (the second resumed at 4 s of productive compute) and a 2 s backoff in 20 s of wall time: the
    first computed 5 s of which 1 s was lost after its checkpoint, the second 5 s, all kept."""
    first = process("a", alive=8.0, compute=5.0)
    second = process("b", alive=8.5, restore=0.5, compute=5.0, restored=4.0)
    parts = run_figures.time_breakdown(20.0, [first, second], productive_seconds=9.0, backoff_seconds=2.0)
    assert list(parts) == list(run_figures.BREAKDOWN)
    assert parts["productive"] == 9.0 and parts["lost"] == 1.0
    assert parts["startup"] == 2.0 + (20.0 - 2.0 - 16.5)  # in the processes, and while none reported
    assert (parts["restore"], parts["checkpoint"], parts["data_wait"], parts["backoff"]) == (0.5, 1.0, 0.5, 2.0)
    assert parts["other"] == 20.0 - sum(v for k, v in parts.items() if k != "other")
    assert abs(parts["other"] - (16.5 - 2.0 - 0.5 - 1.0 - 0.5 - 10.0)) < 1e-9  # the processes' own unaccounted time


def test_a_resumed_invocation_counts_only_the_productive_time_it_added():
    parts = run_figures.time_breakdown(
        10.0, [process("a", alive=9.0, compute=6.0, restored=100.0)], productive_seconds=105.0
    )
    assert (parts["productive"], parts["lost"]) == (5.0, 1.0)
    assert (
        run_figures.time_breakdown(3.0, [], productive_seconds=0.0)["startup"] == 3.0
    )  # nothing reported: all startup
