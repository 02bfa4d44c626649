"""Trainer._charge_save_slowdown: the time a background save adds to the steps beside it is "checkpoint" time."""

from types import SimpleNamespace

import pytest

from trainingrun_trainer.checkpoint_interval import SaveCosts
from trainingrun_trainer.timekeeping import ProcessClock
from trainingrun_trainer.trainer import Trainer


def accounting():
    """The parts of a Trainer the charge reads and writes: a save's progress, the clock and productive time."""
    return SimpleNamespace(
        save_slowdown=SaveCosts(),
        _beside_save=False,
        session=SimpleNamespace(saving=False),
        clock=ProcessClock("pod-0"),
        productive_seconds=0.0,
    )


def step(trainer, compute):
    trainer.clock.add("compute", compute)
    trainer.productive_seconds += compute
    Trainer._charge_save_slowdown(trainer, compute)


def test_the_steps_a_background_save_slowed_give_their_extra_time_to_checkpoint():
    trainer = accounting()
    for _ in range(10):
        step(trainer, 0.1)
    trainer.session.saving, trainer._beside_save = True, True  # Trainer._save staged a background save
    step(trainer, 0.25)
    step(trainer, 0.2)
    assert trainer.clock.seconds["checkpoint"] == 0  # known only once the save is done
    trainer.session.saving = False
    step(trainer, 0.15)  # the write ended during this step
    assert trainer.clock.seconds["checkpoint"] == pytest.approx(0.15 + 0.1 + 0.05)
    assert trainer.productive_seconds == pytest.approx(1.3)  # 13 steps of the usual 0.1 s
    assert trainer.clock.seconds["compute"] == pytest.approx(1.3)
    step(trainer, 0.1)  # no save beside it: all productive
    assert trainer.clock.seconds["checkpoint"] == pytest.approx(0.3) and not trainer._beside_save


def test_without_a_save_nothing_is_charged():
    trainer = accounting()
    for compute in (0.1, 0.3, 0.1, 0.2):
        step(trainer, compute)
    assert trainer.clock.seconds["checkpoint"] == 0 and trainer.productive_seconds == pytest.approx(0.7)
