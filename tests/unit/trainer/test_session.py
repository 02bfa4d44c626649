"""session.Run: what resume loads, whatever the operator's resume point says."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from trainingrun_api.checkpoint_config import CheckpointConfig
from trainingrun_api.progress_report import Report
from trainingrun_trainer.context import RunContext
from trainingrun_trainer.reporting import ProgressReporter
from trainingrun_trainer.session import Run

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def run_in(root, resume_from=None, local_rank=0, committed_step_file=None) -> Run:
    """A Run of attempt 2 checkpointing below `root` (keep 10)."""
    context = rank_zero_context(
        attempt=2,
        resume_from=resume_from,
        pod_name="demo-a2-worker-0",
        rank=local_rank,
        local_rank=local_rank,
        committed_step_file=committed_step_file,
    )
    return Run(
        context,
        CheckpointConfig(uri=f"file://{root}", keep=10),
        reporter=ProgressReporter(None, Report("ns", "demo", "u", 2)),
        handle_sigterm=False,
    )


def run_with(config: CheckpointConfig, context: RunContext | None = None) -> Run:
    """A Run of `config` for attempt 1's rank 0 (or `context`), reporting to nobody, SIGTERM left alone."""
    context = context or rank_zero_context()
    return Run(context, config, reporter=ProgressReporter(None, Report("ns", "demo", "u", 1)), handle_sigterm=False)


def rank_zero_context(**overrides) -> RunContext:
    """Attempt 1's rank 0 of run demo, alone."""
    fields = dict(
        name="demo",
        namespace="ns",
        uid="u",
        attempt=1,
        config_path="unused",
        resume_from=None,
        metrics_port=None,
        pod_name="p",
        rank=0,
        local_rank=0,
        world_size=1,
    )
    return RunContext(**{**fields, **overrides})


def saved_at(run: Run, *steps: int) -> dict[int, torch.Tensor]:
    weights = {}
    for step in steps:
        model = nn.Linear(2, 2)
        torch.nn.init.constant_(model.weight, float(step))
        run.save(step, {"model": model.state_dict()}, {"step": step}, blocking=True)
        weights[step] = model.weight.detach().clone()
    run.report_committed()
    return weights


def test_the_operators_resume_point_is_a_floor_not_a_pin(tmp_path, caplog):
    """A worker group restarted within an attempt keeps the attempt's TRAININGRUN_RESUME_FROM (the checkpoint
    the attempt started from): it resumes from the newest committed checkpoint all the same."""
    writer = run_in(tmp_path)
    weights = saved_at(writer, 10, 20, 30)
    restarted = run_in(tmp_path, resume_from=f"file://{tmp_path}/step-00000010")
    state = {"model": nn.Linear(2, 2).state_dict()}
    extra = restarted.resume(state)
    assert extra["step"] == 30 and torch.equal(state["model"]["weight"], weights[30])


@pytest.mark.parametrize(
    "resume_from, said",
    [
        ("s3://elsewhere/x/step-00000030", "ignoring TRAININGRUN_RESUME_FROM"),
        ("{root}/step-00000040", "is not a valid checkpoint any more: resuming from {root}/step-00000020"),
    ],
)
def test_a_resume_point_elsewhere_or_gone_is_never_loaded(tmp_path, caplog, resume_from, said):
    weights = saved_at(run_in(tmp_path), 10, 20)
    root = f"file://{tmp_path}"
    run = run_in(tmp_path, resume_from=resume_from.format(root=root))
    state = {"model": nn.Linear(2, 2).state_dict()}
    with caplog.at_level(logging.WARNING, logger="trainingrun.session"):
        assert run.resume(state)["step"] == 20
    assert torch.equal(state["model"]["weight"], weights[20])
    assert said.format(root=root) in caplog.text


class SteppingClock:
    """time.monotonic for session: the test moves it."""

    def __init__(self):
        self.now = 100.0

    def monotonic(self):
        return self.now


def auto_run_in(root, attempt=1, restart_count=0) -> Run:
    uri = f"file://{root}"
    context = RunContext(
        name="demo",
        namespace="ns",
        uid="u",
        attempt=attempt,
        config_path="unused",
        resume_from=None,
        metrics_port=None,
        pod_name="demo-a1-worker-0",
        rank=0,
        local_rank=0,
        world_size=1,
        restart_count=restart_count,
    )
    config = CheckpointConfig.model_validate(
        {"uri": uri, "interval": {"steps": "auto", "minSteps": 4, "maxSteps": 1000}}
    )
    return Run(
        context, config, reporter=ProgressReporter(None, Report("ns", "demo", "u", attempt)), handle_sigterm=False
    )


def train(run: Run, clock: SteppingClock, first: int, last: int, *, step_seconds=0.1, save_cost=0.5) -> list[int]:
    """Steps first..last of 0.1 s each; a save makes its step `save_cost` longer. Returns the steps saved at."""
    saved = []
    model = nn.Linear(2, 2)
    for step in range(first, last + 1):
        clock.now += step_seconds
        _, save = run.agree(step)
        if save:
            run.save(step, {"model": model.state_dict()}, {"step": step}, blocking=True)
            clock.now += save_cost
            saved.append(step)
    return saved


def on_the_clock(monkeypatch, clock) -> None:
    """`Run` (session.py and its IntervalPolicy, session_intervals.py) reads time from `clock`."""
    from trainingrun_trainer import session, session_intervals

    for module in (session, session_intervals):
        monkeypatch.setattr(module, "time", clock)


def test_auto_interval_saves_early_to_measure_a_save_then_follows_youngs_rule(tmp_path, monkeypatch):
    import math

    clock = SteppingClock()
    on_the_clock(monkeypatch, clock)
    run = auto_run_in(tmp_path)
    assert run.resume({"model": nn.Linear(2, 2).state_dict()}) is None  # counts the run's first start
    saved = train(run, clock, 1, 1500)
    young = round(math.sqrt(2 * 0.5 * 3600) / 0.1)  # 600 steps: cost 0.5 s, step 0.1 s, the prior's 1 h
    assert saved[:3] == [4, 4 + young, 4 + 2 * young]
    choice = run.interval_choice()
    assert (choice.steps, choice.save_cost_seconds, choice.failures) == (young, 0.5, 0)
    assert choice.expected_lost_seconds == pytest.approx(young * 0.1 / 2)


def test_a_restart_counts_as_a_failure_and_carries_the_save_cost(tmp_path, monkeypatch):

    clock = SteppingClock()
    on_the_clock(monkeypatch, clock)
    first = auto_run_in(tmp_path)
    first.resume({"model": nn.Linear(2, 2).state_dict()})
    train(first, clock, 1, 10)  # saves at 4 (cost unknown), then the cost is measured
    first.save(10, {"model": nn.Linear(2, 2).state_dict()}, {"step": 10}, blocking=True)  # carries the cost
    first.close()

    restarted = auto_run_in(tmp_path, restart_count=1)  # torchrun restarted the group in place
    extra = restarted.resume({"model": nn.Linear(2, 2).state_dict()})
    assert extra == {"step": 10}  # the carried cost is the session's, not the loop's
    choice = restarted.interval_choice()
    assert choice.failures == 1 and choice.save_cost_seconds == 0.5


def test_a_start_of_another_run_on_the_same_uri_starts_the_count_over(tmp_path):
    from trainingrun_trainer.checkpoint import CheckpointStore

    store = CheckpointStore(f"file://{tmp_path}/ckpt")
    assert store.record_start("run-a", now=10.0) == (10.0, 0)
    assert store.record_start("run-a", now=50.0) == (10.0, 1)
    assert store.record_start("run-b", now=90.0) == (90.0, 0)
    (tmp_path / "ckpt" / "starts.json").write_text("{torn")
    assert store.record_start("run-b", now=99.0) == (99.0, 0)
    assert store.list() == []  # not a checkpoint


@pytest.mark.parametrize("setting", [None, True, False])
def test_the_removed_writer_process_setting_is_accepted_and_said_to_be_ignored(tmp_path, setting, caplog):
    """A spec written for an older version still runs (the field is in the CRD), and the log says to remove it."""
    uri = f"file://{tmp_path}"
    config = CheckpointConfig.model_validate({"uri": uri, **({} if setting is None else {"writerProcess": setting})})
    with caplog.at_level("WARNING", logger="trainingrun.session"):
        run = run_with(config)
    run.close()
    said = [r.getMessage() for r in caplog.records if "writerProcess" in r.getMessage()]
    assert said == ([] if setting is None else [config.deprecated_fields()[0]])
    assert setting is None or "deprecated and ignored" in said[0] and "remove the field" in said[0]


@pytest.mark.parametrize("local_rank", [0, 1])
def test_local_rank_zero_tells_the_launcher_each_committed_step(tmp_path, local_rank):
    told = tmp_path / "committed-step"
    run = run_in(tmp_path / "ckpt", local_rank=local_rank, committed_step_file=str(told))
    saved_at(run, 10)
    assert (told.read_text() if told.exists() else None) == ("10" if local_rank == 0 else None)
    saved_at(run, 20)
    assert (told.read_text() if told.exists() else None) == ("20" if local_rank == 0 else None)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("committed-step")] == (
        ["committed-step"] if local_rank == 0 else []
    )


def test_a_launcher_file_that_cannot_be_written_costs_a_warning_not_the_step(tmp_path, caplog):
    run = run_in(tmp_path / "ckpt", committed_step_file=str(tmp_path / "no-such-dir" / "committed-step"))
    with caplog.at_level(logging.WARNING, logger="trainingrun.session"):
        saved_at(run, 10)
    assert run.last_committed.step == 10
    assert "could not record committed step 10 for the launcher" in caplog.text


def run_as(root, uid, resume_from=None) -> Run:
    uri = f"file://{root}"
    context = RunContext(
        name="demo",
        namespace="ns",
        uid=uid,
        attempt=1,
        config_path="unused",
        resume_from=None,
        metrics_port=None,
        pod_name="demo-a1-worker-0",
        rank=0,
        local_rank=0,
        world_size=1,
    )
    config = CheckpointConfig(uri=uri, keep=10, resume_from=resume_from)
    return Run(context, config, reporter=ProgressReporter(None, Report("ns", "demo", uid, 1)), handle_sigterm=False)


def test_a_run_created_again_on_a_uri_with_another_runs_checkpoints_stops_and_says_how_to_continue(tmp_path):
    """It must neither resume from them unasked (issue 35) nor start over beside them unseen."""
    from trainingrun_api.model_base import ConfigError

    saved_at(run_as(tmp_path, "first-uid"), 10, 20)
    with pytest.raises(
        ConfigError,
        match=r"holds checkpoints of another run \(uid first-uid, newest "
        rf"file://{tmp_path}/step-00000020\).*set spec.checkpoint.resumeFrom",
    ):
        run_as(tmp_path, "second-uid").resume({"model": nn.Linear(2, 2).state_dict()})


def test_resume_from_starts_from_another_runs_checkpoint_and_never_writes_there(tmp_path, caplog):
    weights = saved_at(run_as(tmp_path / "first", "first-uid"), 10, 20)
    source = f"file://{tmp_path}/first/step-00000010"
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "first").rglob("*")}
    run = run_as(tmp_path / "second", "second-uid", resume_from=source)
    state = {"model": nn.Linear(2, 2).state_dict()}
    with caplog.at_level(logging.INFO, logger="trainingrun.session"):
        assert run.resume(state)["step"] == 10
    assert torch.equal(state["model"]["weight"], weights[10])
    assert f"resumed from {source} at step 10" in caplog.text and "checkpoint.resumeFrom: read only" in caplog.text
    saved_at(run, 30)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "first").rglob("*")} == before
    # once the run has a checkpoint of its own, it resumes from that
    assert run_as(tmp_path / "second", "second-uid", resume_from=source).resume(state)["step"] == 30


def test_resume_from_on_the_same_uri_continues_a_run_that_was_created_again(tmp_path):
    saved_at(run_as(tmp_path, "first-uid"), 10, 20)
    again = run_as(tmp_path, "second-uid", resume_from=f"file://{tmp_path}/step-00000020")
    assert again.resume({"model": nn.Linear(2, 2).state_dict()})["step"] == 20
    saved_at(again, 30)
    assert run_as(tmp_path, "second-uid").resume({"model": nn.Linear(2, 2).state_dict()})["step"] == 30


def test_a_save_that_waits_for_the_one_before_it_is_said_once_and_counted(tmp_path, caplog, monkeypatch):
    """An interval shorter than a commit: the next save finds the previous one still writing and waits for it."""
    import threading

    run = run_in(tmp_path)
    store = run.store
    gates: dict[int, threading.Event] = {}  # a save's write commits only once the next save has begun
    write = store.committer.run
    monkeypatch.setattr(store.committer, "run", lambda job: (gates[job.step].wait(60), write(job))[1])
    report_committed = run.report_committed

    def next_save_begins():
        for step, gate in gates.items():
            if step < max(gates):
                gate.set()
        return report_committed()

    monkeypatch.setattr(run, "report_committed", next_save_begins)
    model = nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="trainingrun.session"):
        for step in (1, 2, 3):
            gates[step] = threading.Event()
            run.save(step, {"model": model.state_dict()}, {"step": step})
        gates[3].set()
        run.report_committed()
    said = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(said) == 1 and "the checkpoint of step 2 waited" in said[0]
    assert "spec.checkpoint.interval" in said[0] and "trainingrun_checkpoint_wait_seconds_total" in said[0]
    assert run.checkpoint_wait_seconds > 0
    assert store.metrics.committed_saves == 3


class RecordingReporter(ProgressReporter):
    """Records the checkpoints the run tells its reporter of (rank 0 sends them to the operator)."""

    def __init__(self):
        super().__init__(None, Report("ns", "demo", "u", 1))
        self.in_memory, self.in_storage = [], []

    def committed_in_memory(self, checkpoint):
        self.in_memory.append(checkpoint.step)

    def committed(self, checkpoint):
        self.in_storage.append(checkpoint.step)


def test_persisting_behind_the_run_reports_the_newest_checkpoint_in_memory_and_the_newest_in_storage(tmp_path):
    import uuid

    uri = f"file://{tmp_path}/ckpt"
    context = rank_zero_context(uid=f"test-{uuid.uuid4().hex}")
    reporter = RecordingReporter()
    run = Run(context, CheckpointConfig(uri=uri), reporter=reporter, handle_sigterm=False)
    try:
        assert run.store.persist_behind
        model = nn.Linear(2, 2)
        run.save(10, {"model": model.state_dict()}, {"step": 10})
        run.report_committed()
        assert reporter.in_memory == [10]  # at once; storage gets it behind
        assert run.store.flush().step == 10
        run.agree_async(11)  # any step after the copy reached storage reports it
        assert reporter.in_storage == [10]
        run.save(20, {"model": model.state_dict()}, {"step": 20})
        run.report_committed()
        run.agree_async(21)
        assert reporter.in_memory == [10, 20]  # once each
    finally:
        run.close(finished=True)
    assert reporter.in_storage == [10, 20]


def test_the_storage_interval_of_the_spec_reaches_the_store(tmp_path):
    import pydantic

    uri = f"file://{tmp_path}"
    run = run_with(CheckpointConfig.model_validate({"uri": uri, "storageInterval": {"seconds": 600}}))
    try:
        assert run.store.storage_interval == (None, 600)
    finally:
        run.close()
    with pytest.raises(pydantic.ValidationError, match="checkpoint.storageInterval.steps, .seconds or both"):
        CheckpointConfig.model_validate({"uri": uri, "storageInterval": {}})
    with pytest.raises(pydantic.ValidationError, match="storageInterval.steps\n.*neither a whole number.*or auto"):
        CheckpointConfig.model_validate({"uri": uri, "storageInterval": {"steps": "often"}})


def test_an_auto_storage_interval_is_chosen_from_what_a_copy_cost_the_steps_beside_it(tmp_path, monkeypatch, caplog):
    import math
    import threading
    import uuid

    clock = SteppingClock()
    on_the_clock(monkeypatch, clock)
    # restarts inside the pod: the storage interval does not count them
    context = rank_zero_context(uid=f"test-{uuid.uuid4().hex}", restart_count=2)
    config = CheckpointConfig.model_validate(
        {"uri": f"file://{tmp_path}/ckpt", "interval": {"steps": 5}, "storageInterval": {"steps": "auto"}}
    )
    run = run_with(config, context)
    gate = threading.Event()
    upload = run.store.context.storage.upload
    monkeypatch.setattr(run.store.context.storage, "upload", lambda *args: (gate.wait(30), upload(*args))[1])
    model = nn.Linear(2, 2)
    try:
        chooser = run.intervals.auto
        assert chooser.storage_auto and not chooser.memory_auto
        assert run.store.storage_interval[0] is None  # every checkpoint, until a copy is measured
        for step in range(1, 6):  # usual steps of 0.1 s; the fixed interval saves at 5
            clock.now += 0.1
            assert run.agree(step)[1] == (step == 5)
        run.save(5, {"model": model.state_dict()}, {"step": 5})
        run.report_committed()  # in memory; its copy to storage waits at the gate
        for step in (6, 7, 8):  # beside the copy (6 also beside the save): 0.2 s slower each
            clock.now += 0.3
            run.agree(step)
        with caplog.at_level(logging.INFO, logger="trainingrun.session"):
            gate.set()
            run.store.wait_persisted()
            clock.now += 0.1
            run.agree(9)
        cost = (0.2 + 0.2 + 0.0) * 4 / 3  # steps 7-9 alone, scaled to the four the copy ran beside
        young = round(math.sqrt(2 * cost * 3600) / 0.1)
        assert chooser.persist_cost == pytest.approx(cost)
        assert run.store.storage_interval[0] == young
        choice = run.interval_choice()
        assert (choice.storage_steps, choice.failures, choice.steps) == (young, 2, None)
        assert any(f"storage interval (auto): every {young} steps" in r.getMessage() for r in caplog.records)
        run.save(10, {"model": model.state_dict()}, {"step": 10})
        run.report_committed()
        run.store.wait_persisted()
        assert run.store.in_storage.step == 5  # held back: not `young` steps past the last copy
        assert run.store.flush().step == 10  # the end of the run copies the newest whatever the interval
    finally:
        gate.set()
        run.close()


def test_a_test_sessions_trainers_keep_their_copies_in_its_own_folder_in_node_memory(tmp_path):
    """conftest.py gives the session its own folder (TRAININGRUN_MEMORY_TIER_ROOT): the clean-up after each test
    removes what appeared there, never another session's or a user's `trainingrun local` copies in /dev/shm."""
    import os

    from trainingrun_api import contract

    root = os.environ[contract.MEMORY_TIER_ROOT_ENV]
    assert os.path.isdir(root) and os.path.realpath(root) != os.path.realpath(contract.MEMORY_TIER_ROOT)
    assert contract.memory_tier_dir("uid", 1).startswith(root + "/")
    run = run_with(CheckpointConfig.model_validate({"uri": f"file://{tmp_path}"}))
    try:
        assert run.store.memory_tier is not None and run.store.memory_tier.startswith(root + "/")
    finally:
        run.close()


def test_a_restore_says_where_its_bytes_came_from_in_words():
    from trainingrun_trainer.session import restore_bytes_words, restore_source_words

    assert restore_source_words("peer") == "a peer's memory"
    assert restore_source_words("memory and storage") == "node memory and storage"
    assert restore_source_words("peer and storage") == "a peer's memory and storage"
    words = restore_bytes_words({"own_memory": 0, "peer": 5 << 20, "storage": 0})
    assert words == "0 B from own memory, 5.0 MiB from peer, 0 B from storage"


@pytest.mark.slow
def test_a_script_that_configured_no_logging_sees_the_runs_lines(tmp_path):
    """Issue 78 item 6: on main Run.from_env's info lines (what a resume read, and from where) were invisible in a
    script that only prints: Python shows only warnings then. A script of its own, run as a user would."""
    from environments import run_script

    config = tmp_path / "run.yaml"
    config.write_text(
        "apiVersion: trainingrun.dev/v1alpha1\nkind: TrainingRun\nmetadata: {name: mine}\n"
        f"spec:\n  checkpoint: {{uri: 'file://{tmp_path}/ckpt', memoryTier: false}}\n"
    )
    script = (
        "import torch\n"
        "from trainingrun_trainer import Run\n"
        "run = Run.from_env(handle_sigterm=False)\n"
        "model = torch.nn.Linear(2, 2)\n"
        "print('resumed', run.resume({'model': model.state_dict()}))\n"
    )
    done = run_script(script, config)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed None" in done.stdout
    assert " INFO trainingrun" in done.stderr, done.stderr[-2000:]
    # A script that configures its logging after Run.from_env sees each line once, in its own format.
    configured = script.replace(
        "model = torch",
        "import logging\nlogging.basicConfig(level=logging.INFO, format='mine %(message)s')\nmodel = torch",
    )
    done = run_script(configured, config)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "no checkpoint to resume from" in line]
    assert len(lines) == 1 and lines[0].startswith("mine "), done.stderr[-2000:]
