"""session.Run: what resume loads, whatever the operator's resume point says."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from trainingrun_trainer.config import CheckpointConfig
from trainingrun_trainer.context import RunContext
from trainingrun_trainer.contract import Report
from trainingrun_trainer.reporting import ProgressReporter
from trainingrun_trainer.session import Run

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def run_in(root, resume_from=None) -> Run:
    uri = f"file://{root}"
    context = RunContext(name="demo", namespace="ns", uid="u", attempt=2, config_path="unused", checkpoint_uri=uri,
                         resume_from=resume_from, metrics_port=None, pod_name="demo-a2-worker-0", rank=0,
                         local_rank=0, world_size=1)
    return Run(context, CheckpointConfig(uri=uri, keep=10), reporter=ProgressReporter(None, Report("ns", "demo", "u", 2)),
               handle_sigterm=False)


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


@pytest.mark.parametrize("resume_from, said", [
    ("s3://elsewhere/x/step-00000030", "ignoring TRAININGRUN_RESUME_FROM"),
    ("{root}/step-00000040", "is not a valid checkpoint any more: resuming from {root}/step-00000020"),
])
def test_a_resume_point_elsewhere_or_gone_is_never_loaded(tmp_path, caplog, resume_from, said):
    weights = saved_at(run_in(tmp_path), 10, 20)
    root = f"file://{tmp_path}"
    run = run_in(tmp_path, resume_from=resume_from.format(root=root))
    state = {"model": nn.Linear(2, 2).state_dict()}
    with caplog.at_level(logging.WARNING, logger="trainingrun.session"):
        assert run.resume(state)["step"] == 20
    assert torch.equal(state["model"]["weight"], weights[20])
    assert said.format(root=root) in caplog.text
