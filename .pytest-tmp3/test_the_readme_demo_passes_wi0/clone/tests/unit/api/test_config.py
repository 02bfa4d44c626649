"""The trainer config models: torch-free, camelCase on the wire, same shape as the TrainingRun."""

import subprocess
import sys

import pytest
import yaml
from pydantic import ValidationError

from trainingrun_api.config import RunConfig


def test_config_and_operator_cli_import_no_torch():
    code = "import sys, trainingrun_api.config, trainingrun_operator.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_run_config_round_trips_through_the_wire_form():
    config = RunConfig.from_wire(
        {
            "trainer": {"maxSteps": 5, "model": {"classPath": "a.B", "initArgs": {"dimX": 3}}},
            "checkpoint": {"uri": "gs://bkt/p"},
        }
    )
    again = RunConfig.from_wire(config.to_wire())
    assert again == config and again.trainer.model.init_args == {"dimX": 3}
    with pytest.raises(ValidationError):
        RunConfig.from_wire({"trainer": {"max_steps": 5}, "checkpoint": {"uri": "gs://bkt/p"}})


def test_the_checkpoint_interval_is_chosen_from_measured_costs_unless_the_spec_sets_one():
    """Persisting behind, a save costs training little, so the measured choice checkpoints often: losing a worker
    costs a few steps, not a fixed 500."""
    config = RunConfig.from_wire({"trainer": {"maxSteps": 5}, "checkpoint": {"uri": "gs://bkt/p"}})
    assert config.checkpoint.interval.auto and config.checkpoint.persist_behind
    fixed = RunConfig.from_wire(
        {"trainer": {"maxSteps": 5}, "checkpoint": {"uri": "gs://bkt/p", "interval": {"steps": 50}}}
    )
    assert fixed.checkpoint.interval.steps == 50 and not fixed.checkpoint.interval.auto


def test_the_config_file_the_operator_writes_reads_back_equal(tmp_path):
    """JSON, read with json: YAML 1.1 (PyYAML) would read 1e-08 as a string and `on` as true."""
    from trainingrun_api import contract
    from trainingrun_api.config import config_json, load_config

    config = RunConfig.from_wire(
        {
            "trainer": {
                "optimizer": {"eps": 1e-08, "lr": 3e-4},
                "model": {
                    "classPath": "trainingrun_trainer.models.CharTransformer",
                    "initArgs": {"on": "no", "y": 1e-08, "text": "\u00e9\u2028\t", "nested": [{"off": None}]},
                },
            },
            "checkpoint": {"uri": "file:///ckpt"},
        }
    )
    path = tmp_path / contract.CONFIG_FILE_NAME
    path.write_text(config_json(config))
    assert load_config(str(path)) == config
    assert isinstance(yaml.safe_load(path.read_text())["trainer"]["model"]["initArgs"]["y"], str)  # the trap avoided


def test_a_config_file_that_is_not_json_names_the_file(tmp_path):
    from trainingrun_api.config import load_config
    from trainingrun_api.model_base import ConfigError

    path = tmp_path / "config.json"
    path.write_text("trainer: {}\n")
    with pytest.raises(ConfigError, match=r"config.json is not valid JSON"):
        load_config(str(path))


def test_a_trainingrun_file_is_a_trainer_config_too(tmp_path):
    """Issue 78 item 6: on main TRAININGRUN_CONFIG pointing at the TrainingRun file a user already has was refused
    (`apiVersion ... Extra inputs are not permitted`): its spec.trainer and spec.checkpoint are the config."""
    from trainingrun_api.config import load_config

    path = tmp_path / "run.yaml"
    path.write_text(
        "apiVersion: trainingrun.dev/v1alpha1\nkind: TrainingRun\nmetadata: {name: mine}\n"
        "spec:\n  replicas: {min: 2}\n  checkpoint: {uri: 's3://bucket/mine'}\n  trainer: {maxSteps: 7}\n"
    )
    config = load_config(str(path))
    assert config.checkpoint.uri == "s3://bucket/mine" and config.trainer.max_steps == 7
