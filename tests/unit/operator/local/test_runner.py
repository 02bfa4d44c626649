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
        local.runner.Launcher,
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
        local.runner.Launcher, "start", classmethod(lambda cls, node, command, env, log: started.append(command))
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
        local.runner.Launcher,
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
