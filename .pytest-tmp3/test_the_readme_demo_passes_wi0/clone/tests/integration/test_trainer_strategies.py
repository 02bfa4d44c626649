"""The other run paths of the loop: FSDP2 sharding, activation checkpointing, torch.compile, bf16."""

import subprocess
import sys

import pytest
import yaml

from environments import inherited
from tiny_runs import tiny_trainer
from trainingrun_trainer.checkpoint import CheckpointStore

TINY = tiny_trainer(samples=2048, layers=2, logIntervalSteps=5, maxSteps=20)


def torchrun(tmp_path, name, trainer, nproc=2):
    config = tmp_path / f"{name}.yaml"
    config.write_text(
        yaml.safe_dump(
            {"trainer": trainer, "checkpoint": {"uri": f"file://{tmp_path}/{name}", "interval": {"steps": 10}}}
        )
    )
    env = inherited("TRAININGRUN_", "PET_")
    env.update({"TRAININGRUN_CONFIG": str(config), "OMP_NUM_THREADS": "1"})
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "--max-restarts=0",
            "-m",
            "trainingrun_trainer",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def losses(stderr):
    return [
        float(line.split(" loss ")[1].split()[0])
        for line in stderr.splitlines()
        if "rank0 INFO" in line and " loss " in line and "eval" not in line
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        # FSDP2's EMA: the shadow of each rank's shards follows the optimizer's device flag (`ema.update(skipped=)`).
        {"strategy": "fsdp2", "ema": {"enabled": True}},
        {"strategy": "fsdp2", "activationCheckpointing": True, "precision": "bf16-mixed"},
        {"activationCheckpointing": True, "ema": {"enabled": True}},
        {"precision": "bf16-true"},
    ],
    ids=["fsdp2-ema", "fsdp2-actckpt-bf16mixed", "ddp-actckpt-ema", "bf16-true"],
)
def test_run_paths_train_checkpoint_and_resume(tmp_path, options):
    trainer = {**TINY, **options}
    first = torchrun(tmp_path, "run", trainer)
    assert first.returncode == 0, first.stderr[-4000:]
    curve = losses(first.stderr)
    assert curve[-1] < curve[0], curve
    infos = [i for i in CheckpointStore(f"file://{tmp_path}/run").list() if i.valid]
    assert sorted(i.step for i in infos) == [10, 20]
    assert all(i.model_digest for i in infos)
    resumed = torchrun(tmp_path, "run", {**trainer, "maxSteps": 30})
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "at step 20" in resumed.stderr


@pytest.mark.slow
def test_fsdp2_checkpoint_loads_in_one_process_with_the_same_digest(tmp_path):
    """A sharded 2-rank checkpoint loads into a plain 1-process model whose digest (of full tensors) matches."""
    from trainingrun_trainer.checkpoint import model_digest
    from trainingrun_trainer.models import CharTransformer

    sharded = torchrun(tmp_path, "run", {**TINY, "strategy": "fsdp2"})
    assert sharded.returncode == 0, sharded.stderr[-4000:]
    store = CheckpointStore(f"file://{tmp_path}/run")
    info = next(i for i in store.list() if i.step == 20)
    model = CharTransformer(dim=16, layers=2, heads=2, context_length=16)
    state = {"model": model.state_dict()}
    fresh_digest = model_digest(state["model"])
    store.load(info, state)
    assert model_digest(state["model"]) == info.model_digest != fresh_digest


@pytest.mark.slow
def test_torch_compile_single_process(tmp_path):
    result = torchrun(tmp_path, "compiled", {**TINY, "compile": True, "maxSteps": 6}, nproc=1)
    assert result.returncode == 0, result.stderr[-4000:]
    assert [i.step for i in CheckpointStore(f"file://{tmp_path}/compiled").list() if i.valid] == [6]
