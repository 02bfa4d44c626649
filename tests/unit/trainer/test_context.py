"""context: what the trainer reads from its environment; the chaos kill steps, one per worker group."""

import pytest


def test_chaos_kill_steps_are_taken_one_per_worker_group():
    from trainingrun_trainer.context import ContextError, chaos_step

    assert chaos_step("300,450", 0) == 300
    assert chaos_step("300,450", 1) == 450  # the group torchrun restarted once does not die at 300 again
    assert chaos_step("300,450", 2) is None
    assert chaos_step("", 0) is None
    with pytest.raises(ContextError, match="TRAININGRUN_CHAOS_KILL_AT_STEP"):
        chaos_step("3OO", 0)
