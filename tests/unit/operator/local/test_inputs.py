"""local.inputs: what `trainingrun local` fills in for a laptop run, the .env file's lines, and secrets resolved by
name only (never a value in an error), and a run name that would point outside the runs directory read nowhere."""

from __future__ import annotations

import re

import pytest
import yaml
from local_documents import BODY, write_minimal

from trainingrun_operator import local, validation
from trainingrun_operator.local import inputs
from trainingrun_operator.local.inputs import (
    LocalOptions,
    LocalRunError,
    load_run,
    read_env_file,
    resolve_secrets,
)


def written(tmp_path, document: dict) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(document))
    return str(path)


def test_a_laptop_run_gets_a_checkpoint_uri_below_the_runs_folder_one_replica_and_its_uid_kept(tmp_path, minimal_body):
    del minimal_body["spec"]["checkpoint"]["uri"], minimal_body["metadata"]["uid"]
    minimal_body["spec"]["replicas"] = {"min": 4, "max": 8}
    options = LocalOptions(runs_dir=str(tmp_path / "runs"), max_steps=12)
    run = load_run(written(tmp_path, minimal_body), options)
    assert run.spec.checkpoint.uri == f"file://{tmp_path / 'runs'}/demo/checkpoints"
    assert run.spec.replicas.min == 1 and run.spec.trainer.max_steps == 12
    again = load_run(written(tmp_path, minimal_body), options)
    assert again.metadata.uid  # a fresh uid until the ledger saves one (the runner does)


def test_a_run_name_that_points_outside_the_runs_folder_is_refused_and_reads_nothing_there(
    tmp_path, minimal_body, monkeypatch
):
    read = []
    monkeypatch.setattr(inputs.RunLedger, "load", lambda run_dir, *args: read.append(run_dir))
    minimal_body["metadata"]["name"] = "../elsewhere"
    del minimal_body["metadata"]["uid"]
    with pytest.raises(validation.InvalidTrainingRun, match="metadata.name"):
        load_run(written(tmp_path, minimal_body), LocalOptions(runs_dir=str(tmp_path / "runs")))
    assert read == []  # no run.json looked for at runs/../elsewhere


def test_env_file_lines_take_comments_export_and_quotes(tmp_path):
    env = tmp_path / ".env"
    env.write_text("# tracker\nexport WANDB_API_KEY='abc=def'\n\nAWS_ACCESS_KEY_ID = \"AKIA\"\nPLAIN=x y\n")
    assert read_env_file(str(env)) == {"WANDB_API_KEY": "abc=def", "AWS_ACCESS_KEY_ID": "AKIA", "PLAIN": "x y"}
    assert read_env_file(str(tmp_path / "missing")) == {}


def test_a_bad_env_line_is_named_by_its_number_never_shown(tmp_path):
    env = tmp_path / ".env"
    env.write_text("OK=1\nhunter2-without-a-key\n")
    with pytest.raises(LocalRunError) as refused:
        read_env_file(str(env))
    assert f"{env}:2: expected KEY=VALUE" in str(refused.value) and "hunter2" not in str(refused.value)


def test_secrets_come_from_the_environment_first_and_a_missing_one_is_named_by_what_it_stands_for(
    tmp_path, minimal_body
):
    minimal_body["spec"]["secrets"] = {
        "s3Credentials": {"secretName": "s3-keys"},
        "env": [{"name": "WANDB_API_KEY", "secretName": "tracker", "key": "api-key"}],
    }
    spec = validation.parse(minimal_body).spec
    env = tmp_path / ".env"
    env.write_text("AWS_ACCESS_KEY_ID=from-file\nAWS_SECRET_ACCESS_KEY=file-secret\nWANDB_API_KEY=file-key\n")
    values = resolve_secrets(spec, {"AWS_ACCESS_KEY_ID": "from-environment"}, str(env))
    assert values == {
        "AWS_ACCESS_KEY_ID": "from-environment",
        "AWS_SECRET_ACCESS_KEY": "file-secret",
        "WANDB_API_KEY": "file-key",
    }
    env.write_text("AWS_SECRET_ACCESS_KEY=file-secret\n")
    with pytest.raises(LocalRunError) as missing:
        resolve_secrets(spec, {"AWS_ACCESS_KEY_ID": "from-environment"}, str(env))
    message = str(missing.value)
    assert "WANDB_API_KEY (secrets.env tracker/api-key)" in message and ".env" in message
    assert "from-environment" not in message and "file-secret" not in message


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
    with pytest.raises(local.LocalOptionError, match=r"--chaos-lose-node loses one of several .* add --nodes 2"):
        local.check_options(run, local.LocalOptions(chaos_lose_node_step=5))
    with pytest.raises(local.LocalOptionError, match=r"--chaos-lose-node 11 is past the run's last step \(10"):
        local.check_options(run, local.LocalOptions(chaos_lose_node_step=11, nodes=2))
    local.check_options(run, local.LocalOptions(chaos_lose_node_step=10, nodes=2))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(local.LocalOptionError, match=f"--metrics-port {port} is in use"):
            local.check_options(run, local.LocalOptions(metrics_port=port))
    local.check_options(run, local.LocalOptions(metrics_port=port))  # free again


def test_a_chaos_slow_rank_that_cannot_work_is_refused_naming_the_fix(tmp_path):
    run = local.load_run(str(write_minimal(tmp_path)), local.LocalOptions())
    local.check_options(run, local.LocalOptions(nproc=2, chaos_slow_rank="3"))
    local.check_options(run, local.LocalOptions(nproc=2, chaos_slow_rank="2.5:0"))
    for raw, said in (
        ("fast", "write FACTOR or FACTOR:RANK"),
        ("1", "write FACTOR or FACTOR:RANK"),  # not slower
        ("3:x", "write FACTOR or FACTOR:RANK"),
        ("3:2", "the run has ranks 0 to 1"),
    ):
        with pytest.raises(local.LocalOptionError, match=re.escape(said)):
            local.check_options(run, local.LocalOptions(nproc=2, chaos_slow_rank=raw))
    with pytest.raises(local.LocalOptionError, match="this run has one process; add --nproc 2"):
        local.check_options(run, local.LocalOptions(nproc=1, chaos_slow_rank="3"))
    run.spec.recovery.slow_rank_factor = 0
    with pytest.raises(local.LocalOptionError, match="slowRankFactor is 0 \\(off\\)"):
        local.check_options(run, local.LocalOptions(nproc=2, chaos_slow_rank="3"))


def test_nodes_beyond_what_a_machine_simulates_or_beside_a_metrics_port_are_refused(tmp_path):
    run = local.load_run(str(write_minimal(tmp_path)), local.LocalOptions())
    local.check_options(run, local.LocalOptions(nodes=2))
    with pytest.raises(local.LocalOptionError, match=r"--nodes 9: a local run simulates 1 to 8 nodes"):
        local.check_options(run, local.LocalOptions(nodes=9))
    with pytest.raises(local.LocalOptionError, match="--metrics-port serves one launcher's metrics"):
        local.check_options(run, local.LocalOptions(nodes=2, metrics_port=9464))


@pytest.mark.parametrize("written_as", ["checkpoint:\n", "checkpoint: {}\n", ""], ids=["empty key", "{}", "none"])
def test_an_empty_checkpoint_section_is_the_same_as_none(tmp_path, written_as):
    """Issue 78 item 8: on main `checkpoint:` with nothing under it (YAML's null) validated, and the local run then
    wrote to the pod default /tmp/trainingrun/checkpoints, machine-wide, where the next run under another name
    resumed it."""
    text = (
        "apiVersion: trainingrun.dev/v1alpha1\nkind: TrainingRun\nmetadata: {name: empty}\nspec:\n"
        + "".join("  " + line + "\n" for line in written_as.splitlines())
        + "  trainer:\n"
    )
    path = tmp_path / "run.yaml"
    path.write_text(text)
    run = load_run(str(path), LocalOptions(runs_dir=str(tmp_path / "runs")))
    assert run.spec.checkpoint.uri == f"file://{tmp_path / 'runs'}/empty/checkpoints"
