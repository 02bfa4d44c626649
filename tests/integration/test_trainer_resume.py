"""Exact resume under torchrun: a 2-process run whose worker is SIGKILLed and resumed ends with the
same model digest as an uninterrupted run (deterministic mode, CPU, gloo, file:// checkpoints)."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import pytest
import yaml

from environments import inherited
from process_tree import descendants
from tiny_runs import tiny_trainer
from trainingrun_api import contract
from trainingrun_trainer.checkpoint import CheckpointStore

TRAINER = tiny_trainer(
    maxSteps=40, deterministic=True, logIntervalSteps=1, gradAccumulationSteps=2, ema={"enabled": True}
)
# The masked autoencoder draws its masks from the torch RNG, and evaluation runs between
# checkpoints: resume must restore RNG streams and evaluation must not disturb them.
MAE_TRAINER = {
    **TRAINER,
    "model": {
        "classPath": "trainingrun_trainer.models.MaskedAutoencoder",
        "initArgs": {"imageSize": 8, "patchSize": 4, "dim": 16, "layers": 1, "heads": 2, "decoderDim": 8},
    },
    "data": {
        "dataset": {
            "classPath": "trainingrun_trainer.data.SyntheticImages",
            "initArgs": {"numSamples": 4096, "imageSize": 8},
        },
        "batchSize": 8,
    },
    "eval": {"intervalSteps": 7, "batches": 2},
}


def torchrun(
    tmp_path: Path, name: str, nproc: int = 2, trainer: dict = TRAINER, env: Optional[dict] = None
) -> subprocess.Popen:
    config = tmp_path / f"{name}.yaml"
    uri = f"file://{tmp_path}/{name}"
    config.write_text(yaml.safe_dump({"trainer": trainer, "checkpoint": {"uri": uri, "interval": {"steps": 10}}}))
    environment = inherited("TRAININGRUN_", "PET_")
    environment.update(
        {
            "TRAININGRUN_CONFIG": str(config),
            "TRAININGRUN_NAME": name,
            "OMP_NUM_THREADS": "1",
            "PYTHONFAULTHANDLER": "1",
            **(env or {}),
        }
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "-m",
        "trainingrun_trainer",
    ]
    return subprocess.Popen(command, env=environment, stderr=subprocess.PIPE, text=True, start_new_session=True)


def stderr_of(process: subprocess.Popen, timeout: float = 300) -> str:
    """The run's stderr once it ended. A run still going after `timeout` fails the test with every thread's stack of
    every process of the run (faulthandler, on SIGABRT): a hang says where it hangs."""
    try:
        return process.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        tree = descendants(process.pid)
        for pid in tree:  # workers first: their stacks are the ones that say where
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGABRT)
        try:
            err = process.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            err = process.communicate()[1]
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"the run did not end within {timeout:.0f} s; its stacks:\n{err[-12000:]}") from None


def final_digest(tmp_path: Path, name: str, step: int) -> str:
    infos = {i.step: i for i in CheckpointStore(f"file://{tmp_path}/{name}").list() if i.valid}
    assert step in infos, sorted(infos)
    return infos[step].model_digest


@pytest.fixture(scope="module")
def uninterrupted_digest(tmp_path_factory) -> Callable[[dict], str]:
    """The model digest at step 40 of an uninterrupted run of a trainer: each trainer's run once a module, however
    many tests compare against it (they are deterministic, so a second run would only repeat the first)."""
    digests: dict[str, str] = {}

    def digest(trainer: dict) -> str:
        key = json.dumps(trainer, sort_keys=True)
        if key not in digests:
            root = tmp_path_factory.mktemp("reference")
            reference = torchrun(root, "reference", trainer=trainer)
            err = stderr_of(reference)
            assert reference.returncode == 0, err[-3000:]
            digests[key] = final_digest(root, "reference", 40)
        return digests[key]

    return digest


def killed_at(tmp_path: Path, name: str, step: int, trainer: dict = TRAINER, env: Optional[dict] = None) -> str:
    """Run until one worker SIGKILLs itself right after `step` (the trainer's own fault injection, which first
    makes earlier checkpoints durable), and return the log. Killing from here by reading the log raced: on a
    busy machine the run could finish before the reader got to the step."""
    process = torchrun(tmp_path, name, trainer=trainer, env={**(env or {}), contract.CHAOS_KILL_AT_STEP: str(step)})
    err = stderr_of(process)
    assert process.returncode != 0, err[-3000:]
    assert f"chaos: SIGKILL worker rank {step % 2} at step {step}" in err, err[-3000:]
    return err


@pytest.mark.slow
@pytest.mark.parametrize(
    "kill_after_step,trainer",
    [(11, TRAINER), (15, TRAINER), (15, MAE_TRAINER)],
    ids=["right-after-a-checkpoint", "between-checkpoints", "mae-with-eval-between-checkpoints"],
)
def test_sigkilled_worker_resumes_to_the_same_model(tmp_path, uninterrupted_digest, kill_after_step, trainer):
    killed_at(tmp_path, "interrupted", kill_after_step, trainer=trainer)

    resumed = torchrun(tmp_path, "interrupted", trainer=trainer)
    err = stderr_of(resumed)
    assert resumed.returncode == 0, err[-3000:]
    assert "resumed from" in err and "at step 10" in err
    assert final_digest(tmp_path, "interrupted", 40) == uninterrupted_digest(trainer)


def as_format_1(step_dir: Path) -> None:
    """Rewrite a checkpoint as trainer images before format 2 saved it: DCP held model, optimizer and EMA, and
    each rank's extra-rank-<r>.pt held everything else (step, scheduler, scaler, sampler, guard, RNG...)."""
    import hashlib
    import io
    import json

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from trainingrun_trainer.checkpoint import load_everything

    everything = load_everything(str(step_dir))
    manifest = json.loads((step_dir / "manifest.json").read_text())
    shutil.rmtree(step_dir)
    dcp.save(
        {k: everything[k] for k in ("model", "optim", "ema")},
        storage_writer=FsspecWriter(f"file://{step_dir}"),
        no_dist=True,
    )
    shared = {k: everything.get(k, {}) for k in ("scheduler", "scaler", "sampler", "guard")}  # a disabled scaler: {}
    for rank in range(manifest["world_size"]):
        per_rank = torch.load(io.BytesIO(everything[f"extra-rank-{rank}"]), weights_only=False)
        buffer = io.BytesIO()
        torch.save({**per_rank, **shared, **everything["train"]}, buffer)
        (step_dir / f"extra-rank-{rank}.pt").write_bytes(buffer.getvalue())
    files = [
        {"path": p.name, "size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in sorted(step_dir.iterdir())
    ]
    (step_dir / "manifest.json").write_text(json.dumps({**manifest, "format_version": 1, "files": files}))


@pytest.mark.slow
def test_a_checkpoint_from_before_format_2_resumes_to_the_same_model(tmp_path, uninterrupted_digest):
    """An operator upgrade mid-run: the next attempt's trainer resumes from a checkpoint the older image wrote."""
    older = torchrun(tmp_path, "older")
    err = stderr_of(older)
    assert older.returncode == 0, err[-3000:]
    for later in ("step-00000030", "step-00000040"):  # the run got as far as step 20 with the older image
        shutil.rmtree(tmp_path / "older" / later)
    as_format_1(tmp_path / "older" / "step-00000020")
    info = CheckpointStore(f"file://{tmp_path}/older").latest_valid()
    assert info.step == 20 and info.format_version == 1

    resumed = torchrun(tmp_path, "older")
    err = stderr_of(resumed)
    assert resumed.returncode == 0, err[-3000:]
    assert "resumed from" in err and "at step 20" in err
    assert final_digest(tmp_path, "older", 40) == uninterrupted_digest(TRAINER)
