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


def test_the_slow_rank_factor_is_read_defaulted_or_refused_naming_the_field(tmp_path):
    from trainingrun_trainer.context import DEFAULT_SLOW_RANK_FACTOR, ContextError, RunContext

    config = {"TRAININGRUN_CONFIG": str(tmp_path / "config.yaml")}
    assert RunContext.from_env(config).slow_rank_factor == DEFAULT_SLOW_RANK_FACTOR
    assert RunContext.from_env({**config, "TRAININGRUN_SLOW_RANK_FACTOR": "0"}).slow_rank_factor == 0
    assert RunContext.from_env({**config, "TRAININGRUN_SLOW_RANK_FACTOR": "2.5"}).slow_rank_factor == 2.5
    for raw in ("1.05", "fast", "101"):
        with pytest.raises(ContextError, match="spec.recovery.slowRankFactor"):
            RunContext.from_env({**config, "TRAININGRUN_SLOW_RANK_FACTOR": raw})


@pytest.mark.parametrize("restart_count, slow", [("0", (3.0, 1)), ("1", None)])
def test_a_chaos_slow_rank_is_the_last_by_default_and_the_first_group_only(tmp_path, restart_count, slow):
    from trainingrun_trainer.context import ContextError, RunContext

    env = {
        "TRAININGRUN_CONFIG": str(tmp_path / "config.yaml"),
        "TRAININGRUN_CHAOS_SLOW_RANK": "3",
        "WORLD_SIZE": "2",
        "TORCHELASTIC_RESTART_COUNT": restart_count,
    }
    assert RunContext.from_env(env).chaos_slow_rank == slow
    assert RunContext.from_env({**env, "TRAININGRUN_CHAOS_SLOW_RANK": "2:0"}).chaos_slow_rank == (
        (2.0, 0) if slow else None
    )
    with pytest.raises(ContextError, match="TRAININGRUN_CHAOS_SLOW_RANK"):
        RunContext.from_env({**env, "TORCHELASTIC_RESTART_COUNT": "0", "TRAININGRUN_CHAOS_SLOW_RANK": "x"})
