"""Trackers get rank 0's records from a bounded queue; a slow or failing one never holds training."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from tensorboard_events import scalars
from trainingrun_api.logger_config import LoggerConfig
from trainingrun_trainer import tracking
from trainingrun_trainer.background import helper_niceness


class Recording:
    def __init__(self, fail_on=None, gate=None):
        self.records, self.fail_on, self.gate, self.closed = [], fail_on, gate, False

    def start(self, step, config):
        self.niceness = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        self.records.append(("start", step, dict(config)))

    def metrics(self, step, values):
        if self.gate is not None:
            self.gate.wait()
        if self.fail_on == step:
            raise ConnectionError("tracker unreachable")
        self.records.append(("metrics", step, dict(values)))

    def close(self, finished):
        self.closed = "finished" if finished else "stopped"


def test_records_reach_every_tracker_in_order_without_none_values():
    first, second = Recording(), Recording()
    tracker = tracking.Tracker([first, second])
    tracker.start(0, {"maxSteps": 3})
    for step in (1, 2, 3):
        tracker.metrics(step, {"train/loss": 1.0 / step, "train/samples_per_second": None})
    tracker.metrics(3, {"only": None})  # nothing to log: no record
    tracker.close(finished=True)
    expected = [("start", 0, {"maxSteps": 3})] + [("metrics", s, {"train/loss": 1.0 / s}) for s in (1, 2, 3)]
    assert first.records == second.records == expected and first.closed == second.closed == "finished"
    # Delivered by a thread that gives way to the training thread (background.give_way_to_training).
    assert first.niceness == helper_niceness()


def test_a_hung_tracker_drops_records_with_one_warning_and_never_blocks(caplog):
    gate = threading.Event()
    hung = Recording(gate=gate)
    tracker = tracking.Tracker([hung], queue_max=4)
    with caplog.at_level(logging.WARNING, "trainingrun.tracking"):
        for step in range(1, 101):  # the training thread goes on while the tracker is stuck on the first record
            tracker.metrics(step, {"train/loss": 1.0})
        # one record in the tracker's hands, four queued, the rest dropped
        assert 95 <= tracker.dropped <= 96
        assert caplog.text.count("records are dropped") == 1
        tracker.close(timeout=0.2)  # the tracker is still stuck: close gives up after its timeout
        assert "did not finish within" in caplog.text
    gate.set()


def test_a_failing_tracker_is_logged_once_and_still_gets_later_records(caplog):
    flaky = Recording(fail_on=2)
    tracker = tracking.Tracker([flaky])
    with caplog.at_level(logging.WARNING, "trainingrun.tracking"):
        for step in (1, 2, 3, 2):
            tracker.metrics(step, {"train/loss": 0.5})
        tracker.close()
    assert [r[1] for r in flaky.records] == [1, 3]
    assert caplog.text.count("Recording: metrics failed (ConnectionError: tracker unreachable)") == 1


def context(rank):
    from trainingrun_trainer.context import RunContext

    return RunContext(
        name="demo",
        namespace="team-a",
        uid="u-1",
        attempt=1,
        config_path="",
        resume_from=None,
        metrics_port=None,
        pod_name="p",
        rank=rank,
        local_rank=rank,
        world_size=2,
    )


@pytest.mark.slow
def test_only_rank_zero_tracks():
    loggers = [
        LoggerConfig(kind="tensorboard", log_dir="/tmp/tb"),
        LoggerConfig(kind="mlflow", tracking_uri="http://127.0.0.1:9"),
    ]
    assert isinstance(tracking.for_rank(loggers, context(1)), tracking.NullTracker)
    assert isinstance(tracking.for_rank([], context(0)), tracking.NullTracker)
    tracker = tracking.for_rank(loggers, context(0))
    assert [type(b) for b in tracker.backends] == [tracking.TensorBoard, tracking.MLflow]
    assert (tracker.backends[1].experiment, tracker.backends[1].run_uid) == ("team-a", "u-1")  # default: namespace
    tracker.backends = []  # nothing started: close has nothing to close
    tracker.close()


@pytest.mark.parametrize(
    "logger, problem",
    [
        ({"kind": "tensorboard"}, "a tensorboard logger needs logDir"),
        ({"kind": "mlflow"}, "a mlflow logger needs trackingUri"),
        ({"kind": "tensorboard", "logDir": "/tb", "experiment": "e"}, "experiment is for mlflow loggers only"),
        (
            {"kind": "mlflow", "trackingUri": "http://m:5000", "logDir": "/tb"},
            "logDir is for tensorboard and wandb loggers",
        ),
        ({"kind": "wandb"}, "a wandb logger needs project"),
        ({"kind": "tensorboard", "logDir": "/tb", "entity": "team"}, "entity is for wandb loggers only"),
        ({"kind": "mlflow", "trackingUri": "http://m:5000", "project": "p"}, "project is for wandb loggers only"),
    ],
)
def test_each_kind_says_what_it_needs(logger, problem):
    with pytest.raises(ValueError, match=problem):
        LoggerConfig.from_wire(logger)


def test_tensorboard_after_a_resume_shows_each_step_once(tmp_path):
    """An attempt logs steps 1-5 and dies; the next resumes from the checkpoint at step 3 and logs 4-6 again."""
    first = tracking.TensorBoard(str(tmp_path / "tb"))
    first.start(0, {"maxSteps": 6})
    for step in range(1, 6):
        first.metrics(step, {"train/loss": float(step)})
    first.close()
    resumed = tracking.TensorBoard(str(tmp_path / "tb"))
    resumed.start(3, {"maxSteps": 6})
    for step in range(4, 7):
        resumed.metrics(step, {"train/loss": 10.0 * step})
    resumed.close()
    assert scalars(tmp_path / "tb", "train/loss") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]


@pytest.mark.slow
def test_mlflow_keeps_one_run_per_trainingrun_and_each_step_once(tmp_path):
    """An attempt logs steps 1-5 and dies; the next resumes from step 3 and computes 4-7: the run (found by the
    TrainingRun's uid) keeps 4 and 5 as first logged, and gets 6 and 7."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = tracking.MLflow(uri, "team-a", "demo", "u-1", "team-a")
    first.start(0, {"trainer": {"maxSteps": 7, "optimizer": {"lr": 0.001}}, "checkpoint": {"keep": 3}})
    for step in range(1, 6):
        first.metrics(step, {"train/loss": float(step)})
    first.close(finished=False)
    resumed = tracking.MLflow(uri, "team-a", "demo", "u-1", "team-a")
    resumed.start(3, {"trainer": {"maxSteps": 7}})
    assert resumed.run_id == first.run_id and resumed.logged_up_to == 5
    for step in range(4, 8):
        resumed.metrics(step, {"train/loss": 10.0 * step})
    resumed.close(finished=True)

    client = MlflowClient(uri)
    history = sorted((m.step, m.value) for m in client.get_metric_history(first.run_id, "train/loss"))
    assert history == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 60.0), (7, 70.0)]
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "demo"
    assert run.data.params == {"trainer.maxSteps": "7", "trainer.optimizer.lr": "0.001", "checkpoint.keep": "3"}
    assert run.data.tags["trainingrun.uid"] == "u-1"


def offline_wandb_steps(directory, run_id):
    """{run directory: steps of its history records}, as `wandb sync` would upload them into run `run_id`."""
    return {
        path.parent.name: list(tracking.wandb_history_steps(str(path)))
        for path in sorted(directory.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    }


def offline_wandb_steps_once_written(directory, run_id, expected, deadline_s=60.0):
    """offline_wandb_steps once the logs hold `expected` steps, or at the deadline: W&B's service process may still be
    writing a run's transaction log after finish() returned (seen once under CI load)."""
    deadline = time.monotonic() + deadline_s
    while True:
        runs = offline_wandb_steps(directory, run_id)
        if sorted(s for steps in runs.values() for s in steps) == expected or time.monotonic() > deadline:
            return runs
        time.sleep(0.1)


@pytest.mark.slow
def test_wandb_offline_keeps_one_run_id_per_trainingrun_and_each_step_once(tmp_path, monkeypatch):
    """An attempt logs steps 1-5 and stops; the next resumes from step 3 and computes 4-7. Offline, W&B writes a
    directory per process, both for the run's id: the second holds only steps 6 and 7."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = tracking.WandB("proj", None, str(tmp_path), "demo", "u-1", "team-a")
    first.start(0, {"trainer": {"maxSteps": 7}})
    for step in range(1, 6):
        first.metrics(step, {"train/loss": float(step)})
    first.close(finished=False)
    # W&B names a process's directory by the second it started in; a restarted trainer starts seconds later.
    started = int(time.time())
    while int(time.time()) == started:
        time.sleep(0.01)
    resumed = tracking.WandB("proj", None, str(tmp_path), "demo", "u-1", "team-a")
    resumed.start(3, {"trainer": {"maxSteps": 7}})
    assert resumed.logged_up_to == 5
    for step in range(4, 8):
        resumed.metrics(step, {"train/loss": 10.0 * step})
    resumed.close(finished=True)
    runs = offline_wandb_steps_once_written(tmp_path, "u-1", [1, 2, 3, 4, 5, 6, 7])
    assert len(runs) == 2 and sorted(s for steps in runs.values() for s in steps) == [1, 2, 3, 4, 5, 6, 7]


def test_a_torn_wandb_log_is_read_up_to_its_tear(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tracking.WandB("proj", None, str(tmp_path), "demo", "u-2", "team-a")
    run.start(0, {})
    for step in range(1, 2001):  # several 32 KiB blocks, so chunks span blocks
        run.metrics(step, {"train/loss": float(step), "train/lr": 0.1})
    run.close(finished=True)
    offline_wandb_steps_once_written(tmp_path, "u-2", list(range(1, 2001)))
    (path,) = tmp_path.glob("wandb/offline-run-*-u-2/run-u-2.wandb")
    assert list(tracking.wandb_history_steps(str(path))) == list(range(1, 2001))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])  # a killed process: its last blocks never written
    torn = list(tracking.wandb_history_steps(str(path)))
    assert 0 < len(torn) < 2000 and torn == list(range(1, len(torn) + 1))
    path.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])  # a flipped bit: nothing after it is trusted
    assert len(list(tracking.wandb_history_steps(str(path)))) < 2000
