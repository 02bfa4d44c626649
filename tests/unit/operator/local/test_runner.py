"""local.runner.LocalRunner: attempts and in-place restarts named apart, threads per process from the pod's CPUs, the
shell and the file, and a run with another checkpoint URI in its own folder."""

import os

import pytest
from local_documents import write_minimal

from trainingrun_operator import local


def runner_with_groups(tmp_path, *groups):
    """A LocalRunner whose attempts and worker-group starts are `groups`: one attempt number per group start."""
    run = local.load_run(str(write_minimal(tmp_path)), local.LocalOptions(runs_dir=str(tmp_path / "runs")))
    runner = local.LocalRunner(run, local.LocalOptions(runs_dir=str(tmp_path / "runs")), {})
    runner.attempts = [local.Attempt(n) for n in sorted(set(groups))]
    runner.groups = [local.WorkerGroup(n) for n in groups]
    return runner


def test_one_attempt_numbering_with_in_place_restarts_named_apart(tmp_path):
    runner = runner_with_groups(tmp_path, 1, 1, 1, 2)
    assert runner.attempt_count == 2 and runner.restarts_in_place == 2
    assert runner.attempt_label() == "attempt 2"
    runner.groups.append(local.WorkerGroup(2))
    assert runner.attempt_label() == "attempt 2, restart 1 in place"


@pytest.mark.slow
@pytest.mark.parametrize(
    "cpu,nproc,shell,user,expected",
    [
        ("500m", 2, None, None, "1"),  # the pod's share, as the PyTorchJob gets it
        ("8", 1, None, None, "cores"),  # never more than this machine has
        (None, 1, None, None, "cores"),
        ("8", 1, "3", None, "3"),  # the shell's OMP_NUM_THREADS
        ("8", 1, "3", "5", "5"),  # the file's env wins over both
    ],
)
def test_threads_per_process(tmp_path, monkeypatch, cpu, nproc, shell, user, expected):
    body = "apiVersion: trainingrun.dev/v1alpha1\nkind: TrainingRun\nmetadata: {name: laptop}\nspec:\n  trainer: {maxSteps: 10}\n"
    if cpu:
        body += f"  resources: {{cpu: '{cpu}'}}\n"
    if user:
        body += f"  env: [{{name: OMP_NUM_THREADS, value: '{user}'}}]\n"
    path = tmp_path / "run.yaml"
    path.write_text(body)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    if shell:
        monkeypatch.setenv("OMP_NUM_THREADS", shell)
    else:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    options = local.LocalOptions(nproc=nproc, runs_dir=str(tmp_path / "runs"))
    runner = local.LocalRunner(local.load_run(str(path), options), options, secrets={})
    status = local.StatusServer(runner.run, tmp_path / "token")
    try:
        env = runner._environment(1, status, tmp_path / "config.yaml")
    finally:
        status.close()
    assert env["OMP_NUM_THREADS"] == (str(4 // nproc) if expected == "cores" else expected)


def test_a_run_with_another_checkpoint_uri_keeps_its_own_ledger_and_logs(tmp_path):
    """On main a run with another --checkpoint-uri wrote runs/<name>/run.json and attempt-1.log over the first one's."""
    from trainingrun_operator.local.ledger import run_directory

    runs = tmp_path / "runs"
    first = local.load_run(str(write_minimal(tmp_path)), local.LocalOptions(runs_dir=str(runs)))
    runner = local.LocalRunner(first, local.LocalOptions(runs_dir=str(runs)), {})
    assert runner.run_dir == runs / "laptop"
    runner.ledger.save()
    options = local.LocalOptions(runs_dir=str(runs), checkpoint_uri=f"file://{tmp_path}/other")
    elsewhere = local.LocalRunner(local.load_run(str(write_minimal(tmp_path)), options), options, {})
    assert elsewhere.run_dir.parent == runs / "laptop" and elsewhere.run_dir.name.startswith("uri-")
    elsewhere.ledger.save()
    assert local.RunLedger.load(runs / "laptop", first.spec.checkpoint.uri).uid == first.metadata.uid  # kept
    again = local.load_run(str(write_minimal(tmp_path)), options)
    assert again.metadata.uid == elsewhere.ledger.uid  # a rerun there is that run again
    assert run_directory(runs, "laptop", first.spec.checkpoint.uri) == runs / "laptop"


def test_each_simulated_node_is_a_launcher_as_a_pod_is(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(
        local.processes.Launcher,
        "start",
        classmethod(lambda cls, node, command, env, log: started.append((node, command, env, log))),
    )
    monkeypatch.setenv("TRAININGRUN_MEMORY_TIER_ROOT", str(tmp_path / "shm"))
    options = local.LocalOptions(runs_dir=str(tmp_path / "runs"), nodes=3)
    runner = local.LocalRunner(local.load_run(str(write_minimal(tmp_path)), options), options, {})
    runner._start_launchers(2, {"KEPT": "1"}, tmp_path / "attempt-2.log")
    assert [node for node, *_ in started] == [0, 1, 2]
    assert [log.name for *_, log in started] == ["attempt-2.log", "attempt-2-node-1.log", "attempt-2-node-2.log"]
    endpoints = {next(a for a in command if a.startswith("--rdzv-endpoint=")) for _, command, _, _ in started}
    assert len(endpoints) == 1 and endpoints.pop().startswith("--rdzv-endpoint=127.0.0.1:")  # one rendezvous
    for node, command, env, _ in started:
        assert "--nnodes=3" in command and "--standalone" not in command
        assert ("--rdzv-conf=is_host=false" in command) == (node > 0)  # only node 0 takes the store's port
        assert env["TRAININGRUN_POD_NAME"] == f"laptop-a2-worker-{node}" and env["KEPT"] == "1"
        assert env["TRAININGRUN_RENDEZVOUS_HOST_POD"] == "laptop-a2-worker-0"
        memory = env["TRAININGRUN_MEMORY_TIER_ROOT"]
        assert memory.startswith(str(tmp_path / "shm")) and memory.endswith(f"-node-{node}")
    assert len({env["TRAININGRUN_MEMORY_TIER_ROOT"] for _, _, env, _ in started}) == 3  # a node memory each
    runner._free_node_memory()
    assert list((tmp_path / "shm").iterdir()) == []


def test_one_node_is_one_standalone_launcher(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(
        local.processes.Launcher, "start", classmethod(lambda cls, node, command, env, log: started.append(command))
    )
    options = local.LocalOptions(runs_dir=str(tmp_path / "runs"))
    runner = local.LocalRunner(local.load_run(str(write_minimal(tmp_path)), options), options, {})
    runner._start_launchers(1, {}, tmp_path / "attempt-1.log")
    ((command),) = started
    assert "--standalone" in command and not any(a.startswith("--rdzv") for a in command)


def test_only_the_last_node_of_the_first_attempt_is_told_to_be_lost(tmp_path, monkeypatch):
    """--chaos-lose-node: node 0 hosts the rendezvous store (losing it is another failure: its store goes too), and a
    later attempt, or the replacement itself, is never lost again."""
    started = []
    monkeypatch.setattr(
        local.processes.Launcher,
        "start",
        classmethod(lambda cls, node, command, env, log: started.append((node, env))),
    )
    monkeypatch.setenv("TRAININGRUN_MEMORY_TIER_ROOT", str(tmp_path / "shm"))
    options = local.LocalOptions(runs_dir=str(tmp_path / "runs"), nodes=3, chaos_lose_node_step=7)
    runner = local.LocalRunner(local.load_run(str(write_minimal(tmp_path)), options), options, {})
    for attempt in (1, 2):
        runner._start_launchers(attempt, {}, tmp_path / f"attempt-{attempt}.log")
    told = [(node, env.get("TRAININGRUN_CHAOS_LOSE_NODE_AT_STEP")) for node, env in started]
    assert told == [(0, None), (1, None), (2, "7"), (0, None), (1, None), (2, None)]
    runner._free_node_memory()


def test_goodput_keeps_the_earlier_productive_time_when_an_invocation_reports_none(tmp_path):
    """On main an invocation that failed before its processes reported set the whole run's goodput to 0: the
    productive time the run had kept (in its checkpoints) was forgotten, its wall time was not."""
    first = runner_with_groups(tmp_path, 1)
    first.groups[0].resumed = False
    done = first._summary({"progress": {"step": 50, "productiveSeconds": 20.0}}, 40.0, "interrupted", "", [])
    assert done.goodput == pytest.approx(0.5)
    failed = runner_with_groups(tmp_path, 1)
    failed.groups[0].resumed, failed.groups[0].resumed_step = True, 50
    early = failed._summary({}, 10.0, "failed", "", [])
    assert (early.run_wall_seconds, early.run_productive_seconds) == (50.0, 20.0)
    assert early.goodput == pytest.approx(0.4)
    anew = runner_with_groups(tmp_path, 1)  # nothing to resume: the run started over, its time with it
    anew.groups[0].resumed = False
    assert anew._summary({}, 10.0, "failed", "", []).goodput == 0.0


def test_the_summary_averages_throughput_over_every_process_and_reads_the_last_evaluation(tmp_path):
    from trainingrun_api.progress_report import ProcessTime

    runner = runner_with_groups(tmp_path, 1, 1)
    processes = [
        ProcessTime.model_construct(**{**dict.fromkeys(ProcessTime.model_fields, 0.0), "process": "a", **figures})
        for figures in (
            {"compute_seconds": 8.0, "data_wait_seconds": 2.0, "trained_samples": 400.0},  # 40 samples/s
            {"compute_seconds": 4.0, "data_wait_seconds": 0.0, "trained_samples": 800.0},  # 200 samples/s
        )
    ]
    progress = {"step": 60, "samplesPerSecond": 200.0, "evalLoss": 2.5, "evalStep": 50}
    summary = runner._summary({"progress": progress}, 20.0, "succeeded", "", processes)
    assert summary.average_samples_per_second == pytest.approx(1200 / 14)  # not the last reading, 200
    assert (summary.eval_loss, summary.eval_step, summary.process_starts) == (2.5, 50, 2)


@pytest.mark.parametrize("users_own", [False, True])
def test_the_processes_temporary_folder_is_the_invocations_own_unless_the_file_sets_one(tmp_path, users_own):
    body = "apiVersion: trainingrun.dev/v1alpha1\nkind: TrainingRun\nmetadata: {name: laptop}\nspec:\n  trainer: {maxSteps: 10}\n"
    if users_own:
        body += "  env: [{name: TMPDIR, value: /scratch}]\n"
    path = tmp_path / "run.yaml"
    path.write_text(body)
    options = local.LocalOptions(runs_dir=str(tmp_path / "runs"))
    runner = local.LocalRunner(local.load_run(str(path), options), options, secrets={})
    runner.scratch = str(tmp_path / "invocation")
    status = local.StatusServer(runner.run, tmp_path / "token")
    try:
        env = runner._environment(1, status, tmp_path / "config.yaml")
    finally:
        status.close()
    assert env["TMPDIR"] == ("/scratch" if users_own else runner.scratch)
    if not users_own:  # torch.compile's cache stays warm between runs, where torch keeps it by default
        assert os.path.basename(env["TORCHINDUCTOR_CACHE_DIR"]).startswith("torchinductor_")
        assert not env["TORCHINDUCTOR_CACHE_DIR"].startswith(runner.scratch)
