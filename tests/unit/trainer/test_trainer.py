"""Trainer: the time a background save adds to the steps beside it is "checkpoint" time; a step between log lines
never waits for the device (issue 64)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from tiny_runs import tiny_trainer
from trainingrun_trainer.checkpoint_interval import SaveCosts
from trainingrun_trainer.timekeeping import ProcessClock
from trainingrun_trainer.trainer import Trainer

TESTS = Path(__file__).resolve().parents[2]


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


def count_calls_that_wait(tmp_path, device="cpu", **trainer) -> dict[int, int]:
    """Calls that would make the host wait for a GPU, by the step the trainer was at (tests/sync_counting.py), in a
    process of its own."""
    config = {
        "trainer": tiny_trainer(samples=2048, maxSteps=30, logIntervalSteps=10, seed=1, **trainer),
        "checkpoint": {"uri": (tmp_path / "ckpt").as_uri(), "interval": {"steps": 1000}},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, str(TESTS / "sync_counting.py"), str(tmp_path / "config.yaml"), device],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {int(step): calls for step, calls in json.loads(done.stdout.splitlines()[-1]).items()}


def between_log_lines(by_step: dict[int, int]) -> dict[int, int]:
    """Steps 2-28 but those at and just before a log line (every 10): what a step itself does."""
    return {step: by_step.get(step, 0) for step in range(2, 29) if step % 10 not in (0, 9)}


@pytest.mark.slow
@pytest.mark.parametrize(
    "trainer",
    [
        {},
        {"gradAccumulationSteps": 2, "gradClipNorm": 1.0, "ema": {"enabled": True, "decay": 0.99}},
        {"optimizer": {"name": "sgd", "momentum": 0.9}},
    ],
    ids=["defaults", "accumulation-clipping-ema", "sgd-momentum"],
)
def test_a_step_between_log_lines_never_waits_for_the_device(tmp_path, trainer):
    by_step = count_calls_that_wait(tmp_path, **trainer)
    assert between_log_lines(by_step) == dict.fromkeys(between_log_lines(by_step), 0), by_step
    assert by_step.get(0, 0) > 0  # the counter is installed: the DataLoader reads its seed with .item() as it starts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_suite.py runs it)")
def test_a_step_on_a_gpu_never_waits_for_it_by_cudas_own_account(tmp_path):
    """bf16 autocast on the GPU, CUDA's sync debug mode counting every synchronisation the step makes."""
    by_step = count_calls_that_wait(tmp_path, "cuda", precision="bf16-mixed", gradClipNorm=1.0)
    assert between_log_lines(by_step) == dict.fromkeys(between_log_lines(by_step), 0), by_step


@pytest.mark.slow
def test_an_optimizer_a_device_flag_cannot_skip_waits_once_a_step(tmp_path):
    """fused: false (the documented cost): the host reads the non-finite flag before each optimizer step."""
    steps = between_log_lines(count_calls_that_wait(tmp_path, optimizer={"fused": False}))
    assert min(steps.values()) >= 1, steps


SAVES_IN_FLIGHT_AT_EACH_UPDATE = """
import json, sys, time
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from trainingrun_trainer.checkpoint.committing import Committer
from trainingrun_trainer.context import RunContext
from trainingrun_trainer.trainer import Trainer

commit = Committer._commit
def slow_commit(self, *args, **kwargs):  # a commit slower than a step: 0.3 s against the tiny model's few ms
    time.sleep(0.3)
    return commit(self, *args, **kwargs)
Committer._commit = slow_commit
torch.set_num_threads(1)
context = RunContext.from_env()
trainer = Trainer(context.load_config(), context, "cpu")
seen = {}
register_optimizer_step_pre_hook(  # every optimizer's, as the trainer builds its own in run()
    lambda *_: seen.__setitem__(trainer.progress.step + 1, trainer.session.saving)
)
trainer.run()
print(json.dumps({"saving": seen, "persist_behind": trainer.session.store.persist_behind}))
"""


@pytest.mark.slow
def test_the_update_after_a_save_that_commits_in_memory_waits_for_its_commit(tmp_path):
    """A pod lost at any moment costs at most `checkpoint.interval` steps: the update of the step after a save
    (committing in memory) runs only once that save committed, though the commit takes longer than the step."""
    config = {
        "trainer": tiny_trainer(samples=2048, maxSteps=12, logIntervalSteps=100, seed=1),
        "checkpoint": {
            "uri": (tmp_path / "ckpt").as_uri(),
            "interval": {"steps": 5},
            "storageInterval": {"steps": 100},
        },
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "shm").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", SAVES_IN_FLIGHT_AT_EACH_UPDATE],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={
            **os.environ,
            "TRAININGRUN_CONFIG": str(tmp_path / "config.yaml"),
            "TRAININGRUN_NAME": "gate",
            "TRAININGRUN_MEMORY_TIER_ROOT": str(tmp_path / "shm"),
        },
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["persist_behind"], result
    saving = {int(step): flag for step, flag in result["saving"].items()}
    assert sorted(saving) == list(range(1, 13))
    assert [step for step, flag in saving.items() if flag] == [], saving  # steps 6 and 11 waited
