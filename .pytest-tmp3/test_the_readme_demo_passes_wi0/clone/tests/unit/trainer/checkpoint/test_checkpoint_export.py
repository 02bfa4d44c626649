"""A checkpoint as one plain torch.save file (checkpoint/export.py): every format read, nothing invalid exported."""

from __future__ import annotations

import pytest
import torch
from checkpoint_states import app_state, flip_byte, step_dir, trained

from trainingrun_trainer import checkpoint as ckpt
from trainingrun_trainer.checkpoint import CheckpointStore, load_everything, load_plain, to_torch_save

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_a_checkpoint_becomes_one_file_of_everything_it_holds(tmp_path):
    model, opt = trained()
    with CheckpointStore(tmp_path.as_uri()) as store:
        store.save(3, app_state(model, opt), {"step": 3}, blocking=True)
    to_torch_save(str(step_dir(tmp_path, 3)), tmp_path / "plain.pt")
    everything = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert everything["model"].keys() == model.state_dict().keys()
    assert all(torch.equal(everything["model"][name], value) for name, value in model.state_dict().items())
    moments = [state["exp_avg"] for state in opt.state_dict()["state"].values()]
    assert all(
        torch.equal(a, b)
        for a, b in zip([state["exp_avg"] for state in everything["optim"]["state"].values()], moments)
    )
    assert load_plain(everything["extra-rank-0"]) == {"step": 3}


def test_an_invalid_checkpoint_is_not_exported(tmp_path):
    model, opt = trained()
    with CheckpointStore(tmp_path.as_uri()) as store:
        store.save(3, app_state(model, opt), {"step": 3}, blocking=True)
    flip_byte(step_dir(tmp_path, 3) / "__0_0.distcp")
    with pytest.raises(ckpt.CheckpointLoadError, match="xxh3_128 mismatch in __0_0.distcp"):
        load_everything(str(step_dir(tmp_path, 3)))
