"""The trainer's loggers across a SIGKILLed worker and the resumed run: one tracked run, each step once
(TensorBoard read back with its own reader, MLflow through a real server's REST API)."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request

import pytest
from test_trainer_resume import TRAINER, killed_at, stderr_of, torchrun

from tensorboard_events import scalars
from tracking_servers import mlflow_server  # noqa: F401
from trainingrun_trainer import tracking

pytestmark = pytest.mark.slow


def test_one_tensorboard_run_across_a_kill_and_a_resume_with_each_step_once(tmp_path):
    log_dir = tmp_path / "tensorboard"
    trainer = {
        **TRAINER,
        "eval": {"intervalSteps": 10, "batches": 2},
        "loggers": [{"kind": "tensorboard", "logDir": str(log_dir)}],
    }
    killed_at(tmp_path, "tracked", 15, trainer=trainer)
    resumed = torchrun(tmp_path, "tracked", trainer=trainer)
    err = stderr_of(resumed)
    assert resumed.returncode == 0, err[-3000:]

    losses = scalars(log_dir, "train/loss")
    assert [step for step, _ in losses] == list(range(1, 41))  # steps 11-15 of the first attempt are not shown twice
    assert [step for step, _ in scalars(log_dir, "eval/loss")] == [10, 20, 30, 40]
    assert [step for step, value in scalars(log_dir, "run/attempt")] == [0, 10]  # each attempt's start
    committed = [value for _, value in scalars(log_dir, "checkpoint/committed_step")]
    assert committed[-1] == 40 and 30 in committed  # the resumed attempt's commits, the final one included


def kill_and_resume(tmp_path, trainer, env):
    killed_at(tmp_path, "tracked", 15, trainer=trainer, env=env)
    resumed = torchrun(tmp_path, "tracked", trainer=trainer, env=env)
    err = stderr_of(resumed)
    assert resumed.returncode == 0, err[-3000:]


def rest(server, path, **query):
    with urllib.request.urlopen(
        f"{server}/api/2.0/mlflow/{path}?{urllib.parse.urlencode(query)}", timeout=30
    ) as answer:
        return json.load(answer)


def test_one_mlflow_run_across_a_kill_and_a_resume_with_each_step_once(tmp_path, mlflow_server):
    trainer = {**TRAINER, "loggers": [{"kind": "mlflow", "trackingUri": mlflow_server, "experiment": "resume-test"}]}
    kill_and_resume(tmp_path, trainer, env={"TRAININGRUN_UID": "uid-of-tracked", "TRAININGRUN_NAMESPACE": "team-a"})

    experiment = rest(mlflow_server, "experiments/get-by-name", experiment_name="resume-test")["experiment"]
    request = urllib.request.Request(
        f"{mlflow_server}/api/2.0/mlflow/runs/search",
        method="POST",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"experiment_ids": [experiment["experiment_id"]]}).encode(),
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        runs = json.load(answer)["runs"]
    assert len(runs) == 1  # one run for both attempts
    run = runs[0]
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags["trainingrun.uid"] == "uid-of-tracked" and run["info"]["status"] == "FINISHED"
    assert {p["key"]: p["value"] for p in run["data"]["params"]}["trainer.maxSteps"] == "40"
    history = rest(mlflow_server, "metrics/get-history", run_id=run["info"]["run_id"], metric_key="train/loss")
    assert sorted(m["step"] for m in history["metrics"]) == list(range(1, 41))  # steps 11-15 once, not twice


def test_one_wandb_run_across_a_kill_and_a_resume_with_each_step_once(tmp_path):
    """Offline (WANDB_MODE=offline) each process writes a directory of its own, all for the run's id, which is
    the TrainingRun's uid: `wandb sync` uploads them into that one run, where each step is once."""
    directory = tmp_path / "wandb-files"
    trainer = {**TRAINER, "loggers": [{"kind": "wandb", "project": "resume-test", "logDir": str(directory)}]}
    kill_and_resume(
        tmp_path, trainer, env={"TRAININGRUN_UID": "uid-of-tracked", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    )

    runs = {
        path.parent.name: list(tracking.wandb_history_steps(str(path)))
        for path in sorted(directory.glob("wandb/offline-run-*/run-*.wandb"))
    }
    assert len(runs) == 2 and all(name.endswith("-uid-of-tracked") for name in runs), runs.keys()
    first, resumed = runs.values()
    assert first[:16] == list(range(0, 16))  # the attempt's start (run/attempt), then its steps up to the kill
    assert sorted(first + resumed) == list(range(0, 41))  # steps 11-15 once, not twice
