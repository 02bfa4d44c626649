"""The trainer's TensorBoard logger across a SIGKILLed worker and the resumed run: one run, each step once."""
from __future__ import annotations

import pytest

from test_trainer_resume import TRAINER, kill_one_worker_at, torchrun
from tensorboard_events import scalars

pytestmark = pytest.mark.slow


def test_one_tensorboard_run_across_a_kill_and_a_resume_with_each_step_once(tmp_path):
    log_dir = tmp_path / "tensorboard"
    trainer = {**TRAINER, "eval": {"intervalSteps": 10, "batches": 2},
               "loggers": [{"kind": "tensorboard", "logDir": str(log_dir)}]}
    interrupted = torchrun(tmp_path, "tracked", trainer=trainer)
    log = kill_one_worker_at(interrupted, "committed checkpoint step 10 ", "rank0 INFO trainingrun.trainer: step 15/40 ")
    assert interrupted.returncode != 0, "".join(log[-30:])
    resumed = torchrun(tmp_path, "tracked", trainer=trainer)
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]

    losses = scalars(log_dir, "train/loss")
    assert [step for step, _ in losses] == list(range(1, 41))  # steps 11-15 of the first attempt are not shown twice
    assert [step for step, _ in scalars(log_dir, "eval/loss")] == [10, 20, 30, 40]
    assert [step for step, value in scalars(log_dir, "run/attempt")] == [0, 10]  # each attempt's start
    committed = [value for _, value in scalars(log_dir, "checkpoint/committed_step")]
    assert committed[-1] == 40 and 30 in committed  # the resumed attempt's commits, the final one included
