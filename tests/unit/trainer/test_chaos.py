"""chaos: `trainingrun local`'s faults fire at their step on their rank only, after earlier checkpoints are durable;
`--chaos-hang data` makes the next batch block."""

import dataclasses

import pytest

from trainingrun_trainer import chaos
from trainingrun_trainer.context import ChaosHang, RunContext


def context(tmp_path, **changes) -> RunContext:
    base = RunContext(
        name="r", namespace="n", uid="u", attempt=1, config_path=str(tmp_path / "config.json"), resume_from=None,
        metrics_port=None, pod_name="p", rank=1, local_rank=1, world_size=2,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


@pytest.fixture
def unblocked():
    yield
    chaos._DATA_BLOCKED.clear()


def test_nothing_fires_at_other_steps_or_on_other_ranks(unblocked, tmp_path):
    durable = []
    hang = ChaosHang("data", 5)  # the last rank by default
    chaos.after_step(context(tmp_path, chaos_hang=hang), 4, lambda: durable.append(4))
    chaos.after_step(context(tmp_path, chaos_hang=hang, rank=0, local_rank=0), 5, lambda: durable.append(5))
    assert durable == [] and not chaos._DATA_BLOCKED.is_set()


def test_a_data_hang_blocks_the_next_batch_after_earlier_checkpoints_are_durable(unblocked, tmp_path):
    durable = []
    chaos.after_step(context(tmp_path, chaos_hang=ChaosHang("data", 5)), 5, lambda: durable.append(5))
    assert durable == [5] and chaos._DATA_BLOCKED.is_set()  # data_gate now blocks for ever


def test_a_hang_is_injected_once_per_invocation_even_in_a_group_restarted_without_counting(unblocked, tmp_path):
    durable = []
    chaos.after_step(context(tmp_path, chaos_hang=ChaosHang("data", 5)), 5, lambda: durable.append(1))
    chaos._DATA_BLOCKED.clear()
    # the next group on the node of the hung rank: TORCHELASTIC_RESTART_COUNT still 0, so its context has the hang
    chaos.after_step(context(tmp_path, chaos_hang=ChaosHang("data", 5)), 5, lambda: durable.append(2))
    assert durable == [1] and not chaos._DATA_BLOCKED.is_set()
    assert (tmp_path / chaos.HANG_FIRED).exists()  # `trainingrun local` removes it when it starts again


def test_a_chaos_hang_is_parsed_or_refused_by_name():
    from trainingrun_trainer.context import ContextError

    assert ChaosHang.parse("stop:40") == ChaosHang("stop", 40, None)
    assert ChaosHang.parse("block:7:0").fires(7, 0, 4) and not ChaosHang.parse("block:7").fires(7, 0, 4)
    for bad in ("freeze:4", "stop", "stop:x", "stop:0", "stop:4:-1", "stop:4:1:2"):
        with pytest.raises(ContextError, match="TRAININGRUN_CHAOS_HANG"):
            ChaosHang.parse(bad)


def test_a_slow_rank_waits_its_factor_of_the_steps_part_and_no_other_rank_does(tmp_path, monkeypatch):
    slept = []
    monkeypatch.setattr(chaos.time, "sleep", slept.append)
    assert chaos.slow_down(context(tmp_path, chaos_slow_rank=(3.0, 1)), 0.5) == pytest.approx(1.0)
    assert chaos.slow_down(context(tmp_path, chaos_slow_rank=(3.0, 0)), 0.5) == 0.0  # another rank
    assert chaos.slow_down(context(tmp_path), 0.5) == 0.0  # not asked
    assert slept == [pytest.approx(1.0)]
