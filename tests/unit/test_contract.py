"""The torch-free contract between trainer and operator: what both sides compute the same way."""
from trainingrun_trainer import contract


def progress(step, at, total=1000, **more):
    return {"step": step, "updatedAt": f"2026-11-25T10:00:{at:02d}Z", "totalSteps": total, **more}


def test_percent_and_completion_time_come_from_the_step_rate_between_reports():
    first = contract.with_estimates(None, progress(100, 0))
    assert first["percent"] == 10.0 and "estimatedCompletionTime" not in first  # no rate yet
    second = contract.with_estimates(first, progress(110, 10))  # 1 step/s, 890 to go
    assert second["percent"] == 11.0 and second["estimatedCompletionTime"] == "2026-11-25T10:15:00Z"
    assert contract.with_estimates(second, progress(110, 20))["estimatedCompletionTime"] == \
        second["estimatedCompletionTime"]  # a heartbeat keeps it: the status is not rewritten
    resumed = contract.with_estimates(second, progress(50, 30))  # a new attempt resumed below the last step
    assert resumed["estimatedCompletionTime"] is None  # removed, not left stale
    done = contract.with_estimates(second, progress(1000, 40))
    assert done["percent"] == 100.0 and done["estimatedCompletionTime"] == "2026-11-25T10:00:40Z"
    assert contract.with_estimates(None, {"step": 5, "updatedAt": "2026-11-25T10:00:00Z"}) == \
        {"step": 5, "updatedAt": "2026-11-25T10:00:00Z"}  # no totalSteps: nothing to estimate
