"""The trainer config models: torch-free, camelCase on the wire, same shape as the TrainingRun."""
import subprocess
import sys

import pytest
from pydantic import ValidationError

from trainingrun_trainer.config import RunConfig


def test_config_and_operator_cli_import_no_torch():
    code = "import sys, trainingrun_trainer.config, trainingrun_operator.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_run_config_round_trips_through_the_wire_form():
    config = RunConfig.from_wire({"trainer": {"maxSteps": 5, "model": {"classPath": "a.B", "initArgs": {"dimX": 3}}},
                                  "checkpoint": {"uri": "gs://bkt/p"}})
    again = RunConfig.from_wire(config.to_wire())
    assert again == config and again.trainer.model.init_args == {"dimX": 3}
    with pytest.raises(ValidationError):
        RunConfig.from_wire({"trainer": {"max_steps": 5}, "checkpoint": {"uri": "gs://bkt/p"}})
