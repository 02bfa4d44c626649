"""session_intervals.IntervalPolicy alone: when a step checkpoints with fixed intervals (steps, seconds, both), how a
resume and a save move the count, and the warning when saves wait for the one before (said once, always counted).
The auto intervals through Run: tests/unit/trainer/test_session.py."""

from __future__ import annotations

import logging

import pytest
from test_session import rank_zero_context

from trainingrun_api.checkpoint_config import CheckpointConfig
from trainingrun_trainer import session_intervals
from trainingrun_trainer.checkpoint import CheckpointStore
from trainingrun_trainer.session_intervals import IntervalPolicy

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(session_intervals, "time", clock)
    return clock


def policy(tmp_path, interval: dict) -> IntervalPolicy:
    config = CheckpointConfig.model_validate({"uri": f"file://{tmp_path}/ckpt", "interval": interval})
    return IntervalPolicy(config, CheckpointStore(config.uri), rank_zero_context())


def test_a_fixed_step_interval_is_due_at_its_multiples(tmp_path, clock):
    every_5 = policy(tmp_path, {"steps": 5})
    assert [step for step in range(1, 16) if every_5.due(step, save_finished=True)] == [5, 10, 15]
    assert every_5.auto is None and every_5.choice() is None and every_5.save_cost is None


def test_a_seconds_interval_counts_from_the_last_save(tmp_path, clock):
    every_minute = policy(tmp_path, {"seconds": 60})
    assert not every_minute.due(1, save_finished=True)
    clock.now += 60
    assert every_minute.due(2, save_finished=True)
    every_minute.saved(2)
    clock.now += 59
    assert not every_minute.due(3, save_finished=True)
    clock.now += 1
    assert every_minute.due(4, save_finished=True)


def test_steps_and_seconds_together_save_at_whichever_comes_first(tmp_path, clock):
    both = policy(tmp_path, {"steps": 100, "seconds": 30})
    clock.now += 31
    assert both.due(7, save_finished=True)  # 30 s before 100 steps
    both.saved(7)
    assert both.due(100, save_finished=True)  # 100 steps before 30 s


def test_waiting_for_the_save_before_is_counted_every_time_and_said_once(tmp_path, clock, caplog):
    waited = policy(tmp_path, {"steps": 2})
    with caplog.at_level(logging.WARNING, logger="trainingrun.session"):
        waited.waited_for_the_save_before(4, 0.25)
        waited.waited_for_the_save_before(6, 0.5)
    said = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(said) == 1 and "every 2 steps" in said[0] and "spec.checkpoint.interval" in said[0]
    assert waited.wait_seconds == 0.75


def test_an_auto_interval_counts_from_the_step_it_resumed_at(tmp_path, clock):
    auto = policy(tmp_path, {"steps": "auto", "minSteps": 10, "maxSteps": 10})
    assert auto.auto is not None
    auto.resumed(50, save_cost=0.5)
    assert auto.save_cost == 0.5  # carried from the process before
    saved_at = []
    for step in range(51, 81):
        clock.now += 0.1
        if auto.due(step, save_finished=True):
            auto.saved(step)
            saved_at.append(step)
    assert saved_at == [60, 70, 80]  # maxSteps 10 from the step it resumed at, not from step 0
