"""session_reports.RunReports: each checkpoint reported once, where it is (storage, or node memory persisting behind);
the launcher's committed-step file written whole, never failing the step; progress built only for a reporter that
sends."""

from __future__ import annotations

import logging
import math

import pytest
from torch import nn

from trainingrun_api.progress_report import Report
from trainingrun_trainer.checkpoint import CheckpointStore
from trainingrun_trainer.reporting import ProgressReporter
from trainingrun_trainer.session_reports import RunReports

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Recorded(ProgressReporter):
    """A reporter that sends (enabled) and records what it is given instead of sending it."""

    def __init__(self):
        super().__init__(None, Report("ns", "demo", "u", 1))
        self.calls: list[tuple[str, object]] = []

    @property
    def enabled(self) -> bool:
        return True

    def progress(self, progress, process_time=None, interval=None):
        self.calls.append(("progress", progress))

    def committed(self, checkpoint):
        self.calls.append(("committed", checkpoint))

    def committed_in_memory(self, checkpoint):
        self.calls.append(("in memory", checkpoint))

    def memory_short(self, short):
        self.calls.append(("memory short", short))


def saved(store: CheckpointStore, step: int) -> None:
    store.save(step, {"model": nn.Linear(2, 2).state_dict()}, blocking=True)


def test_each_checkpoint_in_storage_is_reported_once_with_its_manifests_sha(tmp_path):
    reporter = Recorded()
    with CheckpointStore(f"file://{tmp_path}/ckpt") as store:
        reports = RunReports(reporter, store, None)
        reports.stored()
        assert reporter.calls == []  # nothing committed yet
        saved(store, 3)
        reports.stored()
        reports.stored()  # every step asks: the same checkpoint is not reported again
        saved(store, 6)
        reports.stored()
    assert [(kind, c.step) for kind, c in reporter.calls] == [("committed", 3), ("committed", 6)]
    assert reporter.calls[-1][1].sha256 == store.in_storage.manifest_sha256
    assert reporter.calls[-1][1].uri == store.in_storage.uri


def test_a_resumed_run_reports_only_the_checkpoints_it_commits(tmp_path):
    with CheckpointStore(f"file://{tmp_path}/ckpt") as store:
        saved(store, 3)
    reporter = Recorded()
    with CheckpointStore(f"file://{tmp_path}/ckpt") as store:
        store.latest_valid()
        reports = RunReports(reporter, store, None)
        reports.resumed()
        reports.stored()
        assert reporter.calls == []  # the operator already knows the one it resumed from
        saved(store, 4)
        reports.stored()
    assert [c.step for _, c in reporter.calls] == [4]


def test_persisting_behind_the_checkpoint_in_memory_is_reported_before_storage_holds_it(tmp_path):
    reporter = Recorded()
    memory = tmp_path / "memory"
    with CheckpointStore(f"file://{tmp_path}/ckpt", memory_tier=str(memory), persist_behind=True) as store:
        reports = RunReports(reporter, store, None)
        store.save(5, {"model": nn.Linear(2, 2).state_dict()})
        store.wait()
        reports.stored()
        assert ("in memory", 5) in [(kind, c.step) for kind, c in reporter.calls]
        store.flush()
        reports.stored()
    assert [(kind, c.step) for kind, c in reporter.calls][-1] == ("committed", 5)


def test_the_launcher_reads_the_newest_committed_step_from_a_file_written_whole(tmp_path, caplog):
    path = tmp_path / "committed-step"
    with CheckpointStore(f"file://{tmp_path}/ckpt") as store:
        reports = RunReports(Recorded(), store, str(path))
        reports.tell_launcher(None)  # a failed save: nothing to tell
        assert not path.exists()
        saved(store, 7)
        reports.tell_launcher(store.wait())
        assert path.read_text() == "7" and not (tmp_path / "committed-step.partial").exists()
        gone = RunReports(Recorded(), store, str(tmp_path / "no-such-dir" / "committed-step"))
        with caplog.at_level(logging.WARNING, logger="trainingrun.session"):
            gone.tell_launcher(store.wait())  # never raises into the step
    assert "could not record committed step 7" in caplog.text


def test_progress_leaves_out_losses_that_are_not_finite_carries_the_last_evaluation_and_is_built_only_for_a_reporter_that_sends(
    tmp_path,
):
    reporter = Recorded()
    figures = dict(
        total_steps=10,
        samples_per_second=5.0,
        productive_seconds=1.23456,
        process_time=None,
        model_flops_per_second=None,
        mfu=0.123456,
        interval_choice=None,
    )
    with CheckpointStore(f"file://{tmp_path}/ckpt") as store:
        RunReports(reporter, store, None).progress(4, loss=math.nan, evaluation=(4, math.inf), **figures)
        RunReports(reporter, store, None).progress(5, loss=2.5, evaluation=(4, 2.75), **figures)
        silent = ProgressReporter(None, Report("ns", "demo", "u", 1))
        RunReports(silent, store, None).progress(6, loss=2.0, **figures)  # off: nothing built, nothing kept
    (_, nan_step), (_, good) = reporter.calls
    assert nan_step.loss is None and good.loss == 2.5
    assert nan_step.eval_loss is None and (good.eval_step, good.eval_loss) == (4, 2.75)  # the last evaluation
    assert good.productive_seconds == 1.235 and good.mfu == 0.1235 and good.step == 5
    assert silent._progress is None


def test_the_pods_short_of_memory_are_reported_when_they_change_and_once_they_fit_again(tmp_path, monkeypatch):
    """status.checkpointMemoryShort (condition CheckpointMemoryShort): nothing while no pod was ever short; the pods
    when a save finds them short, not again for each save that finds the same; none once a checkpoint fits."""
    reporter = Recorded()
    with CheckpointStore(f"file://{tmp_path}/ckpt", memory_tier=str(tmp_path / "tier")) as store:
        reports = RunReports(reporter, store, None)
        monkeypatch.setattr(store.context.held_tier(), "begin", lambda *a, **k: None)
        for step, short in ((3, False), (6, True), (9, True), (12, False)):
            store.context.held_tier().short_of_room = short
            saved(store, step)
            reports.stored()
    told = [(c.step, c.pods) for kind, c in reporter.calls if kind == "memory short"]
    assert told == [(6, [store.context.pods[0]]), (12, [])]
