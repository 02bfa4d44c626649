"""examples/custom_loop.py: a user's own loop gets checkpoints and resume from `Run` under torchrun."""

import os
import subprocess
import sys

import yaml

from environments import inherited
from trainingrun_trainer.checkpoint import CheckpointStore

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_example(tmp_path, steps):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"checkpoint": {"uri": f"file://{tmp_path}/ckpt", "interval": {"steps": 10}}}))
    env = inherited("TRAININGRUN_", "PET_")
    env.update({"TRAININGRUN_CONFIG": str(config), "CUSTOM_LOOP_STEPS": str(steps), "OMP_NUM_THREADS": "1"})
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            os.path.join(REPO, "examples", "custom_loop.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_custom_loop_checkpoints_and_resumes(tmp_path):
    first = run_example(tmp_path, 25)
    assert first.returncode == 0, first.stderr[-3000:]
    steps = sorted(i.step for i in CheckpointStore(f"file://{tmp_path}/ckpt").list() if i.valid)
    assert steps == [10, 20, 25]
    second = run_example(tmp_path, 40)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "at step 25" in second.stderr
    assert "done: step 40" in second.stdout
