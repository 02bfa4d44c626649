"""Exact resume under torchrun: a 2-process run whose worker is SIGKILLed and resumed ends with the
same model digest as an uninterrupted run (deterministic mode, CPU, gloo, file:// checkpoints)."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tiny_runs import tiny_trainer

from trainingrun_trainer.checkpoint import CheckpointStore

TRAINER = tiny_trainer(maxSteps=40, deterministic=True, logIntervalSteps=1, gradAccumulationSteps=2,
                       ema={"enabled": True})
# The masked autoencoder draws its masks from the torch RNG, and evaluation runs between
# checkpoints: resume must restore RNG streams and evaluation must not disturb them.
MAE_TRAINER = {
    **TRAINER,
    "model": {"classPath": "trainingrun_trainer.models.MaskedAutoencoder",
              "initArgs": {"imageSize": 8, "patchSize": 4, "dim": 16, "layers": 1, "heads": 2, "decoderDim": 8}},
    "data": {"dataset": {"classPath": "trainingrun_trainer.data.SyntheticImages",
                         "initArgs": {"numSamples": 4096, "imageSize": 8}}, "batchSize": 8},
    "eval": {"intervalSteps": 7, "batches": 2},
}


def torchrun(tmp_path: Path, name: str, nproc: int = 2, trainer: dict = TRAINER) -> subprocess.Popen:
    config = tmp_path / f"{name}.yaml"
    uri = f"file://{tmp_path}/{name}"
    config.write_text(yaml.safe_dump({"trainer": trainer, "checkpoint": {"uri": uri, "interval": {"steps": 10}}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAININGRUN_", "PET_"))}
    env.update({"TRAININGRUN_CONFIG": str(config), "TRAININGRUN_NAME": name, "OMP_NUM_THREADS": "1"})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--max-restarts=0", "-m", "trainingrun_trainer"]
    return subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)


def final_digest(tmp_path: Path, name: str, step: int) -> str:
    infos = {i.step: i for i in CheckpointStore(f"file://{tmp_path}/{name}").list() if i.valid}
    assert step in infos, sorted(infos)
    return infos[step].model_digest


def kill_one_worker_at(process: subprocess.Popen, *markers: str) -> list[str]:
    """Read the log until every marker was seen, then SIGKILL one worker process (a child of torchrun)."""
    lines, waiting = [], list(markers)
    for line in process.stderr:
        lines.append(line)
        waiting = [m for m in waiting if m not in line]
        if not waiting:
            children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(process.pid)], capture_output=True,
                                      text=True).stdout.split()
            assert children, "torchrun has no worker processes"
            os.kill(int(children[-1]), signal.SIGKILL)
            break
    lines += process.stderr.read().splitlines(keepends=True)
    process.wait(timeout=120)
    return lines


@pytest.mark.slow
@pytest.mark.parametrize(
    "kill_after_step,trainer",
    [(11, TRAINER), (15, TRAINER), (15, MAE_TRAINER)],
    ids=["right-after-a-checkpoint", "between-checkpoints", "mae-with-eval-between-checkpoints"],
)
def test_sigkilled_worker_resumes_to_the_same_model(tmp_path, kill_after_step, trainer):
    reference = torchrun(tmp_path, "reference", trainer=trainer)
    _, err = reference.communicate(timeout=300)
    assert reference.returncode == 0, err[-3000:]

    interrupted = torchrun(tmp_path, "interrupted", trainer=trainer)
    log = kill_one_worker_at(
        interrupted,
        "committed checkpoint step 10 ",  # the kill must come after the commit, else nothing to resume from
        f"rank0 INFO trainingrun.trainer: step {kill_after_step}/40 ",
    )
    assert interrupted.returncode != 0, "".join(log[-30:])

    resumed = torchrun(tmp_path, "interrupted", trainer=trainer)
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert "resumed from" in err and "at step 10" in err
    assert final_digest(tmp_path, "interrupted", 40) == final_digest(tmp_path, "reference", 40)
