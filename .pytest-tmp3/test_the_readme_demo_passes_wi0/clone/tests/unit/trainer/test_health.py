"""health.NonFiniteGuard: skip a non-finite step, roll back after maxConsecutiveNonFinite in a row, abort after
maxRollbacks; a good step resets the count; the counters survive a checkpoint."""

from __future__ import annotations

from trainingrun_api.config import HealthConfig
from trainingrun_trainer.health import NonFiniteGuard, Verdict


def guard(**fields) -> NonFiniteGuard:
    return NonFiniteGuard(HealthConfig(**{"max_consecutive_non_finite": 3, "max_rollbacks": 1, **fields}))


def test_skips_then_rolls_back_then_aborts():
    g = guard()
    verdicts = [g.observe(step, loss_finite=False, grad_finite=True) for step in range(6)]
    assert verdicts == [Verdict.SKIP, Verdict.SKIP, Verdict.ROLLBACK, Verdict.SKIP, Verdict.SKIP, Verdict.ABORT]
    assert g.rollbacks == 1 and g.skipped_total == 6
    message = g.abort_message()
    assert (
        "non-finite loss at step 5" in message
        and "maxRollbacks=1" in message
        and "spec.trainer.optimizer.lr" in message
    )


def test_a_good_step_resets_the_run_of_bad_ones():
    g = guard()
    for step in range(10):
        assert g.observe(step, loss_finite=True, grad_finite=step % 3 != 0) in (Verdict.OK, Verdict.SKIP)
    assert g.rollbacks == 0 and g.skipped_total == 4


def test_the_reason_names_the_gradient_when_only_it_is_bad():
    g = guard()
    g.observe(12, loss_finite=True, grad_finite=False)
    assert g.last_reason == "non-finite gradient norm at step 12"


def test_counters_round_trip_and_an_older_state_without_them_starts_at_zero():
    g = guard()
    for step in range(3):
        g.observe(step, False, False)
    restored = guard()
    restored.load_state_dict(g.state_dict())
    assert (restored.skipped_total, restored.rollbacks) == (3, 1)
    restored.load_state_dict({})
    assert (restored.skipped_total, restored.rollbacks) == (0, 0)
