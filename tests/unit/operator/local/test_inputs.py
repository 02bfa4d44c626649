"""local.inputs: what `trainingrun local` fills in for a laptop run, the .env file's lines, and secrets resolved by
name only (never a value in an error), and a run name that would point outside the runs directory read nowhere."""

from __future__ import annotations

import pytest
import yaml

from trainingrun_operator import validation
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
