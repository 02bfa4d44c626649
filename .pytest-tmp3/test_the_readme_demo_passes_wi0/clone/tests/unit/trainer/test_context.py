"""context: what the trainer reads from its environment; the chaos kill steps, one per worker group; the node lost
once."""

import pytest


def test_chaos_kill_steps_are_taken_one_per_worker_group():
    from trainingrun_trainer.context import ContextError, chaos_step

    assert chaos_step("300,450", 0) == 300
    assert chaos_step("300,450", 1) == 450  # the group torchrun restarted once does not die at 300 again
    assert chaos_step("300,450", 2) is None
    assert chaos_step("", 0) is None
    with pytest.raises(ContextError, match="TRAININGRUN_CHAOS_KILL_AT_STEP"):
        chaos_step("3OO", 0)


@pytest.mark.parametrize("restart_count, lost_at", [("0", 7), ("1", None)])
def test_a_node_is_lost_by_its_first_worker_group_only(tmp_path, restart_count, lost_at):
    from trainingrun_trainer.context import RunContext

    env = {
        "TRAININGRUN_CONFIG": str(tmp_path / "config.yaml"),
        "TRAININGRUN_CHAOS_LOSE_NODE_AT_STEP": "7",
        "TORCHELASTIC_RESTART_COUNT": restart_count,
    }
    assert RunContext.from_env(env).chaos_lose_node_at_step == lost_at
