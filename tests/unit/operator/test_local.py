"""Pure parts of the local runner: defaults, .env parsing, secret resolution, exit classification."""

import os

import pytest

from trainingrun_operator import local

BODY = """\
apiVersion: trainingrun.dev/v1alpha1
kind: TrainingRun
metadata: {name: laptop}
spec:
  trainer: {maxSteps: 10}
  secrets:
    env: [{name: WANDB_API_KEY, secretName: wandb, key: api-key}]
    gcsKeyFile: {secretName: gcs, key: key.json}
"""


def test_checkpoint_uri_defaults_under_runs_and_flags_override(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(BODY)
    run = local.load_run(str(path), local.LocalOptions(runs_dir=str(tmp_path / "runs")))
    assert run.spec.checkpoint.uri == f"file://{tmp_path}/runs/laptop/checkpoints"
    run = local.load_run(str(path), local.LocalOptions(checkpoint_uri="s3://bkt/p", max_steps=3))
    assert run.spec.checkpoint.uri == "s3://bkt/p" and run.spec.trainer.max_steps == 3


def test_a_cluster_file_of_several_pods_runs_locally_on_a_file_uri(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(BODY.replace("spec:\n", "spec:\n  replicas: {min: 2, max: 4}\n  checkpoint: {uri: gs://bkt/p}\n"))
    run = local.load_run(str(path), local.LocalOptions(checkpoint_uri=f"file://{tmp_path}/ckpt"))
    assert run.spec.checkpoint.uri == f"file://{tmp_path}/ckpt" and run.spec.replicas.effective_max == 1


def test_env_file_parsing(tmp_path):
    env = tmp_path / ".env"
    env.write_text("# comment\nexport A=1\nB = 'two words'\nC=\"x=y\"\n\n")
    assert local.read_env_file(str(env)) == {"A": "1", "B": "two words", "C": "x=y"}
    assert local.read_env_file(str(tmp_path / "absent")) == {}
    env.write_text("TOKEN supersecret\n")
    with pytest.raises(local.LocalRunError) as caught:
        local.read_env_file(str(env))
    assert ":1: expected KEY=VALUE" in str(caught.value) and "supersecret" not in str(caught.value)


def test_secrets_come_from_environment_then_env_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(BODY)
    spec = local.load_run(str(path), local.LocalOptions()).spec
    (tmp_path / ".env").write_text("WANDB_API_KEY=from-file\nGOOGLE_APPLICATION_CREDENTIALS=/k.json\n")
    values = local.resolve_secrets(spec, {"WANDB_API_KEY": "from-env"}, str(tmp_path / ".env"))
    assert values == {"WANDB_API_KEY": "from-env", "GOOGLE_APPLICATION_CREDENTIALS": "/k.json"}
    with pytest.raises(
        local.LocalRunError,
        match=r"missing secrets: WANDB_API_KEY \(secrets.env wandb/api-key\), "
        r"GOOGLE_APPLICATION_CREDENTIALS",
    ):
        local.resolve_secrets(spec, {}, str(tmp_path / "none"))


def test_result_line_format():
    summary = local.Summary(
        steps=5,
        final_loss=1.23456,
        attempts=2,
        restarts_in_place=1,
        lost_steps=3,
        goodput=0.91234,
        wall_seconds=12.34,
        outcome="succeeded",
    )
    assert summary.result_line() == (
        "result: steps=5 final_loss=1.2346 attempts=2 restarts_in_place=1 lost_steps=3 goodput=0.912 wall_seconds=12.3"
    )


def test_the_startup_line_adds_up_the_phases():
    summary = local.Summary(
        steps=5,
        final_loss=1.0,
        attempts=1,
        restarts_in_place=0,
        lost_steps=0,
        goodput=0.9,
        wall_seconds=10.0,
        outcome="succeeded",
        startup={
            "imports": 2.0,
            "init": 0.25,
            "model": 0.5,
            "data": 0.25,
            "prepare": 0.5,
            "restore": 0.25,
            "first_step": 1.0,
        },
    )
    assert summary.startup_line() == (
        "start-up: imports 2.0 s + init 0.2 s + model 0.5 s + data 0.2 s + prepare 0.5 s "
        "+ restore 0.2 s + first step 1.0 s = 4.8 s to the first steps of the training "
        "processes"
    )


def test_the_throughput_line_shows_model_flops_and_mfu_when_reported():
    base = dict(
        steps=5,
        final_loss=1.0,
        attempts=1,
        restarts_in_place=0,
        lost_steps=0,
        goodput=0.9,
        wall_seconds=10.0,
        outcome="succeeded",
    )
    assert local.Summary(**base).throughput_line() is None  # nothing reported
    cpu = local.Summary(**base, samples_per_second=320.0, model_flops_per_second=2.5e9)
    assert cpu.throughput_line() == "throughput: 320.0 samples/s, 0.0025 TFLOP/s, MFU - (no GPU peak)"
    gpu = local.Summary(**base, samples_per_second=320.0, model_flops_per_second=4.2e14, mfu=0.4123)
    assert gpu.throughput_line() == "throughput: 320.0 samples/s, 420 TFLOP/s, MFU 41.2%"


def runner_with_groups(tmp_path, *groups):
    """A LocalRunner whose attempts and worker-group starts are `groups`: one attempt number per group start."""
    run = local.load_run(str(write_minimal(tmp_path)), local.LocalOptions(runs_dir=str(tmp_path / "runs")))
    runner = local.LocalRunner(run, local.LocalOptions(runs_dir=str(tmp_path / "runs")), {})
    runner.attempts = [local.Attempt(n) for n in sorted(set(groups))]
    runner.groups = [local.WorkerGroup(n) for n in groups]
    return runner


def write_minimal(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "apiVersion: trainingrun.dev/v1alpha1\nkind: TrainingRun\nmetadata: {name: laptop}\n"
        "spec:\n  trainer: {maxSteps: 10}\n"
    )
    return path


def test_one_attempt_numbering_with_in_place_restarts_named_apart(tmp_path):
    runner = runner_with_groups(tmp_path, 1, 1, 1, 2)
    assert runner.attempt_count == 2 and runner.restarts_in_place == 2
    assert runner.attempt_label() == "attempt 2"
    runner.groups.append(local.WorkerGroup(2))
    assert runner.attempt_label() == "attempt 2, restart 1 in place"


def test_a_rerun_is_the_same_run_and_a_new_checkpoint_uri_a_new_one(tmp_path):
    options = local.LocalOptions(runs_dir=str(tmp_path / "runs"))
    first = local.load_run(str(write_minimal(tmp_path)), options)
    assert not (tmp_path / "runs").exists()  # loading starts nothing and writes nothing
    local.RunLedger.load(tmp_path / "runs" / "laptop", first.spec.checkpoint.uri, uid=first.metadata.uid).save()
    again = local.load_run(str(write_minimal(tmp_path)), options)
    assert again.metadata.uid == first.metadata.uid
    elsewhere = local.load_run(
        str(write_minimal(tmp_path)),
        local.LocalOptions(runs_dir=str(tmp_path / "runs"), checkpoint_uri=f"file://{tmp_path}/other"),
    )
    assert elsewhere.metadata.uid != first.metadata.uid


def test_options_that_could_never_work_are_refused_before_anything_starts(tmp_path):
    import socket

    run = local.load_run(str(write_minimal(tmp_path)), local.LocalOptions())
    with pytest.raises(local.LocalOptionError, match=r"--chaos-kill-step 11 is past the run's last step \(10"):
        local.check_options(run, local.LocalOptions(chaos_kill_steps=[5, 11]))
    local.check_options(run, local.LocalOptions(chaos_kill_steps=[10]))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(local.LocalOptionError, match=f"--metrics-port {port} is in use"):
            local.check_options(run, local.LocalOptions(metrics_port=port))
    local.check_options(run, local.LocalOptions(metrics_port=port))  # free again


def test_displays_render_progress():
    import io

    class FakeRunner:
        @staticmethod
        def attempt_label():
            return "attempt 2"

        class spec:  # noqa: N801 - stands in for the TrainingRunSpec
            class trainer:  # noqa: N801
                max_steps = 100

    status = {"progress": {"step": 50, "totalSteps": 100, "loss": 1.5, "samplesPerSecond": 320.0}}
    out = io.StringIO()
    plain = local.PlainDisplay(out)
    plain(FakeRunner, status)
    plain(FakeRunner, status)  # same step: no second line
    assert out.getvalue() == "attempt 2 step 50/100 loss 1.5000 samples/s 320.0\n"
    rich_out = io.StringIO()
    display = local.RichDisplay(rich_out)
    display(FakeRunner, status)
    display.close()
    assert "attempt 2" in rich_out.getvalue() and "50/100" in rich_out.getvalue()


def test_log_follower_returns_each_complete_line_once(tmp_path):
    path = tmp_path / "attempt-1.log"
    follower = local.LogFollower(path)
    assert follower.new_lines() == []  # not created yet
    path.write_text("one\ntw")
    assert follower.new_lines() == ["one"]
    with open(path, "a") as f:
        f.write("o\nthree\n")
    assert follower.new_lines() == ["two", "three"]
    assert follower.new_lines() == []


def test_chaos_kill_steps_are_taken_one_per_worker_group():
    from trainingrun_trainer.context import ContextError, chaos_step

    assert chaos_step("300,450", 0) == 300
    assert chaos_step("300,450", 1) == 450  # the group torchrun restarted once does not die at 300 again
    assert chaos_step("300,450", 2) is None
    assert chaos_step("", 0) is None
    with pytest.raises(ContextError, match="TRAININGRUN_CHAOS_KILL_AT_STEP"):
        chaos_step("3OO", 0)


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


def test_the_local_report_endpoint_checks_what_the_operator_checks(tmp_path):
    """Same protocol and checks as the operator's endpoint: the bearer token from the file, this run and
    attempt only, checkpoints only under the run's URI; status holds only what was accepted."""
    import json
    import urllib.error
    import urllib.request

    from trainingrun_api.progress_report import CommittedCheckpoint, Progress, Report

    path = tmp_path / "run.yaml"
    path.write_text(BODY)
    run = local.load_run(str(path), local.LocalOptions(runs_dir=str(tmp_path / "runs")))
    status = local.StatusServer(run, tmp_path / "token")
    status.new_attempt(2)
    meta, uri = run.metadata, run.spec.checkpoint.uri

    def post(report, token=None):
        request = urllib.request.Request(
            status.url,
            data=report.to_json(),
            method="POST",
            headers={"Authorization": f"Bearer {token or status.token_file.read_text()}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, ""
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())["message"]

    progress = Progress(5, "2026-11-24T00:00:00Z")
    try:
        assert post(Report(meta.namespace, meta.name, meta.uid, 2, progress=progress), token="guess")[0] == 401
        assert post(Report(meta.namespace, meta.name, meta.uid, 1, progress=progress))[0] == 403
        elsewhere = CommittedCheckpoint("s3://attacker/x/step-00000010", 10, "2026-11-24T00:00:00Z")
        code, message = post(Report(meta.namespace, meta.name, meta.uid, 2, last_good_checkpoint=elsewhere))
        assert code == 403 and "not the step-00000010 directory" in message
        assert status.snapshot() == {}
        good = CommittedCheckpoint(f"{uri}/step-00000010", 10, "2026-11-24T00:00:00Z")
        assert (
            post(Report(meta.namespace, meta.name, meta.uid, 2, progress=progress, last_good_checkpoint=good))[0] == 200
        )
        assert status.snapshot() == {
            "progress": {"step": 5, "updatedAt": "2026-11-24T00:00:00Z"},
            "lastGoodCheckpoint": {"uri": good.uri, "step": 10, "time": good.time},
        }
        # percent and the estimated completion time, as the operator adds them (the step rate between reports)
        for step, at in ((10, "00:00:10"), (20, "00:00:20")):
            report = Report(meta.namespace, meta.name, meta.uid, 2, progress=Progress(step, f"2026-11-24T{at}Z", 100))
            assert post(report)[0] == 200
        assert status.snapshot()["progress"] == {
            "step": 20,
            "updatedAt": "2026-11-24T00:00:20Z",
            "totalSteps": 100,
            "percent": 20.0,
            "estimatedCompletionTime": "2026-11-24T00:01:40Z",
        }
    finally:
        status.close()


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
