"""own_state.py and Run.resume: a loop of its own passes its model and optimizer, and a resume either loads everything
the checkpoint holds or says, in one line, what does not match (issue 78 item 2)."""

from __future__ import annotations

import pytest
import torch
from test_session import run_with
from torch import nn

from environments import run_script
from trainingrun_api.checkpoint_config import CheckpointConfig
from trainingrun_trainer.checkpoint import StateMismatch
from trainingrun_trainer.own_state import OwnState
from trainingrun_trainer.session import Run

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def run_in(tmp_path) -> Run:
    return run_with(CheckpointConfig.model_validate({"uri": f"file://{tmp_path}/ckpt", "memoryTier": False}))


def trained(seed: int = 0, steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(
        same(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k]))
        for k in a
    )


def test_the_model_and_optimizer_themselves_resume_whole(tmp_path):
    model, optimizer = trained()
    run = run_in(tmp_path)
    run.save(2, {"model": model, "optim": optimizer}, {"step": 2}, blocking=True)
    run.close()
    fresh, fresh_optimizer = trained(seed=1, steps=0)  # a new process: the optimizer has taken no step
    extra = run_in(tmp_path).resume({"model": fresh, "optim": fresh_optimizer})
    assert extra == {"step": 2}
    assert same(fresh.state_dict(), model.state_dict())
    assert same(fresh_optimizer.state_dict()["state"], optimizer.state_dict()["state"])


def test_a_resume_into_an_optimizers_empty_state_is_an_error_naming_what_would_stay_unread(tmp_path):
    """On main: 0 optimizer entries loaded without a word, Adam's moments reset."""
    model, optimizer = trained()
    run = run_in(tmp_path)
    run.save(2, {"model": model, "optim": optimizer}, {"step": 2}, blocking=True)
    run.close()
    fresh, fresh_optimizer = trained(seed=1, steps=0)
    with pytest.raises(StateMismatch, match=r"leaves \d+ of its entries unread \(optim\.state\.") as raised:
        run_in(tmp_path).resume({"model": fresh.state_dict(), "optim": fresh_optimizer.state_dict()})
    assert "pass the optimizer itself" in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("saved_as", ["by index", "by name"])
def test_a_checkpoint_saved_in_one_form_and_read_in_the_other_says_so_in_one_line(tmp_path, saved_as):
    """On main: `Missing key in checkpoint state_dict: optimizer.state...step`, retried three times in place."""
    model, optimizer = trained()
    run = run_in(tmp_path)
    by_index = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    run.save(2, by_index if saved_as == "by index" else {"model": model, "optim": optimizer}, blocking=True)
    run.close()
    fresh, fresh_optimizer = trained(seed=1)  # stepped: optimizer.state_dict() has its entries
    read = (
        {"model": fresh, "optim": fresh_optimizer}
        if saved_as == "by index"
        else {"model": fresh.state_dict(), "optim": fresh_optimizer.state_dict()}
    )
    other = "name" if saved_as == "by index" else "index"
    with pytest.raises(
        StateMismatch, match=f"saved keyed by parameter {saved_as[3:]} and is read keyed by parameter {other}"
    ):
        run_in(tmp_path).resume(read)


def test_more_than_one_model_is_refused_saying_what_to_do():
    with pytest.raises(ValueError, match="pass one model and at most one optimizer"):
        OwnState({"a": nn.Linear(1, 1), "b": nn.Linear(1, 1)})


@pytest.mark.slow
def test_a_script_that_lets_the_mismatch_escape_exits_as_a_configuration_error_in_one_line(tmp_path):
    """Not retried: exit_codes.CONFIG_ERROR (2), which the launcher keeps for the rest of the attempt, not a
    traceback's 1."""
    config = tmp_path / "run.yaml"
    config.write_text(f"checkpoint: {{uri: 'file://{tmp_path}/ckpt', memoryTier: false}}\n")
    script = (
        "import torch\n"
        "from trainingrun_trainer import Run\n"
        "model = torch.nn.Linear(2, 2); opt = torch.optim.AdamW(model.parameters())\n"
        "model(torch.ones(1, 2)).sum().backward(); opt.step()\n"
        "run = Run.from_env(handle_sigterm=False)\n"
        "if run.resume({'model': model, 'optim': opt}) is None:\n"
        "    run.save(1, {'model': model, 'optim': opt}, blocking=True)\n"
        "else:\n"
        "    run.resume({'model': model.state_dict(), 'optim': opt.state_dict()})\n"
        "run.close()\n"
    )
    first = run_script(script, config)
    assert first.returncode == 0, first.stderr[-2000:]
    second = run_script(script, config)
    assert second.returncode == 2, second.stderr[-2000:]
    assert "Traceback" not in second.stderr
    assert "trainingrun: cannot load" in second.stderr and "keyed by parameter" in second.stderr
