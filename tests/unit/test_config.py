"""The trainer config models: torch-free, camelCase on the wire, same shape as the TrainingRun."""

import subprocess
import sys

import pytest
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
