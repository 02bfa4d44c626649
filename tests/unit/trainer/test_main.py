"""`python -m trainingrun_trainer` as a pod runs it (one process here; torchrun tests come with the runtime)."""

import os
import subprocess
import sys

import pytest
import yaml

from environments import inherited
from tiny_runs import tiny_trainer
from trainingrun_api import exit_codes
from trainingrun_trainer.checkpoint import CheckpointStore

TINY = tiny_trainer(samples=512, deterministic=True, logIntervalSteps=5)


def run_trainer(tmp_path, trainer, checkpoint_uri, extra_env=None):
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump({"trainer": trainer, "checkpoint": {"uri": checkpoint_uri, "interval": {"steps": 10}}})
    )
    env = inherited("TRAININGRUN_", "RANK", "WORLD_SIZE")
    env.update({"TRAININGRUN_CONFIG": str(config), "TRAININGRUN_NAME": "t", **(extra_env or {})})
    return subprocess.run(
        [sys.executable, "-m", "trainingrun_trainer"], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_trains_checkpoints_and_resumes_where_it_stopped(tmp_path):
    uri = f"file://{tmp_path}/ckpt"
    first = run_trainer(tmp_path, {**TINY, "maxSteps": 20}, uri)
    assert first.returncode == exit_codes.OK, first.stderr[-3000:]
    steps = sorted(i.step for i in CheckpointStore(uri).list() if i.valid)
    assert steps == [10, 20]
    second = run_trainer(tmp_path, {**TINY, "maxSteps": 30}, uri)
    assert second.returncode == exit_codes.OK, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "at step 20" in second.stderr
    assert max(i.step for i in CheckpointStore(uri).list() if i.valid) == 30


@pytest.mark.slow
def test_bad_class_path_fails_fast_with_a_permanent_code(tmp_path):
    trainer = {**TINY, "model": {"classPath": "trainingrun_trainer.models.NoSuchModel"}}
    result = run_trainer(tmp_path, trainer, f"file://{tmp_path}/ckpt")
    assert result.returncode == exit_codes.CONFIG_ERROR
    assert "spec.trainer.model.classPath" in result.stderr and "Traceback" not in result.stderr


def test_missing_config_variable(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRAININGRUN_CONFIG"}
    result = subprocess.run([sys.executable, "-m", "trainingrun_trainer"], env=env, capture_output=True, text=True)
    assert result.returncode == exit_codes.CONFIG_ERROR and "TRAININGRUN_CONFIG is not set" in result.stderr


@pytest.mark.slow
def test_periodic_evaluation_on_the_held_out_split(tmp_path):
    trainer = {**TINY, "maxSteps": 20, "eval": {"intervalSteps": 10, "batches": 2}, "ema": {"enabled": True}}
    result = run_trainer(tmp_path, trainer, f"file://{tmp_path}/ckpt")
    assert result.returncode == exit_codes.OK, result.stderr[-3000:]
    evals = [line for line in result.stderr.splitlines() if "eval step" in line]
    assert len(evals) == 2 and "eval step 10 eval_loss" in evals[0] and "eval_loss_ema" in evals[0]


def test_a_dead_peer_is_retryable_not_a_bug():
    import torch.distributed as dist

    from trainingrun_trainer.checkpoint import PeersLost
    from trainingrun_trainer.main import peer_failure

    assert peer_failure(dist.DistBackendError("NCCL communicator was aborted"))
    assert peer_failure(PeersLost("checkpoint step 5 could not commit: ..."))  # the commit's collective failed first
    assert peer_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
    assert not peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not peer_failure(ValueError("Connection reset by peer"))


@pytest.mark.slow
def test_checkpoint_storage_down_at_start_is_retryable_not_permanent(tmp_path):
    """An S3 endpoint that refuses connections (a port nothing listens on): exit 138, so the operator retries the
    attempt after its backoff instead of failing the run for a short outage; the message names the URI."""
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        result = run_trainer(
            tmp_path,
            {**TINY, "maxSteps": 5},
            "s3://bucket/run",
            extra_env={
                "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
                "AWS_ACCESS_KEY_ID": "test",
                "AWS_SECRET_ACCESS_KEY": "test",
                "AWS_MAX_ATTEMPTS": "1",
            },
        )
    assert result.returncode == exit_codes.RETRYABLE, result.stderr[-3000:]
    assert not exit_codes.is_permanent(result.returncode)
    assert "trainingrun-trainer: cannot list the checkpoints under s3://bucket/run" in result.stderr


def test_the_runs_checkpoint_uri_comes_from_the_config_file_alone(tmp_path, monkeypatch):
    """The operator writes the URI a run started with into the config file, its one channel; a variable of the
    old second channel changes nothing, and every part of the process (trainer, custom loops) writes there."""
    from trainingrun_trainer.context import RunContext
    from trainingrun_trainer.session import Run

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"trainer": TINY, "checkpoint": {"uri": f"file://{tmp_path}/started"}}))
    env = {"TRAININGRUN_CONFIG": str(config), "TRAININGRUN_CHECKPOINT_URI": "s3://not/a/channel"}
    assert RunContext.from_env(env).load_config().checkpoint.uri == f"file://{tmp_path}/started"
    for name, value in env.items():  # Run.from_env reads the process environment, as a custom loop does
        monkeypatch.setenv(name, value)
    run = Run.from_env(handle_sigterm=False)
    assert run.store.uri == f"file://{tmp_path}/started"
    run.close()


@pytest.mark.slow
def test_the_log_line_of_a_step_shows_the_learning_rate_that_step_used(tmp_path):
    """On main the line of step k showed the rate of step k+1 (the schedule had already moved)."""
    import re

    trainer = {**TINY, "maxSteps": 10, "optimizer": {"lr": 0.02}, "schedule": {"warmupSteps": 20}}
    result = run_trainer(tmp_path, trainer, f"file://{tmp_path}/ckpt")
    assert result.returncode == exit_codes.OK, result.stderr[-3000:]
    rates = dict(re.findall(r"step (\d+)/10 loss \S+ grad_norm \S+ lr (\S+)", result.stderr))
    assert rates == {"5": "0.005", "10": "0.01"}  # warmup: step k (1-based) runs at 0.02 x k / 20


@pytest.mark.slow
def test_periodic_evaluation_on_a_dataset_of_its_own(tmp_path):
    """eval.dataset is what evaluation reads: a seeded synthetic set of another seed evaluates, one whose class
    is misspelt stops the trainer naming spec.trainer.eval.dataset before a step."""
    evaluated = {
        "classPath": "trainingrun_trainer.data.SyntheticText",
        "initArgs": {"numSamples": 64, "contextLength": 16, "seed": 7},
    }
    trainer = {**TINY, "maxSteps": 10, "eval": {"intervalSteps": 5, "batches": 2, "dataset": evaluated}}
    result = run_trainer(tmp_path, trainer, f"file://{tmp_path}/ckpt")
    assert result.returncode == exit_codes.OK, result.stderr[-3000:]
    assert len([line for line in result.stderr.splitlines() if "eval step" in line]) == 2
    evaluated["classPath"] = "trainingrun_trainer.data.SyntheticTxt"
    result = run_trainer(tmp_path, trainer, f"file://{tmp_path}/other")
    assert result.returncode == exit_codes.CONFIG_ERROR
    assert "spec.trainer.eval.dataset.classPath" in result.stderr and "Traceback" not in result.stderr


def test_a_checkpoint_of_another_model_is_not_advised_to_be_moved_aside():
    """Issue 78 item 11: after a model change every older checkpoint has the same shapes, so moving the newest aside
    (the advice on main) cannot help; a damaged one still gets it."""
    from trainingrun_trainer.main import _load_error_fix

    changed = (
        "cannot load file:///c/step-1: rank 0: ValueError: Size mismatch between saved torch.Size([4, 4]) and current"
    )
    assert "another checkpoint.uri" in _load_error_fix(changed) and "aside" not in _load_error_fix(changed)
    assert "aside" in _load_error_fix("cannot load s3://b/step-2: it holds more than plain values")
