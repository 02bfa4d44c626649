"""model_contract.py: what the trainer asks of a model, each mistake one line that names it and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainingrun_api.model_base import ConfigError
from trainingrun_trainer import model_contract


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 2)


def loss_of(net: Net) -> torch.Tensor:
    return net.layer(torch.ones(1, 2)).sum()


def test_a_scalar_loss_that_requires_grad_passes():
    model_contract.check_loss(loss_of(Net()), Net())


@pytest.mark.parametrize(
    "output, said",
    [
        (lambda n: {"loss": loss_of(n), "logits": torch.ones(2, 3)}, "returned a dict, not the loss: return `.loss`"),
        (lambda n: {"logits": torch.ones(2, 3)}, "(it has none: pass `labels` so the model computes one)"),
        (lambda n: torch.ones(2, 3, 5, requires_grad=True), "returned a tensor of shape [2, 3, 5] (logits?)"),
        (lambda n: loss_of(n).detach(), "does not require grad"),
        (lambda n: torch.tensor(3), "returned a torch.int64 scalar"),
        (lambda n: (loss_of(n), 1), "returned a tuple, not the loss"),
    ],
    ids=["model output", "output without loss", "logits", "detached", "integer", "tuple"],
)
def test_what_is_not_the_loss_is_named_in_one_line(output, said):
    net = Net()
    with pytest.raises(ConfigError) as raised:
        model_contract.check_loss(output(net), net)
    message = str(raised.value)
    assert said in message and message.startswith("spec.trainer.model: Net.forward") and "\n" not in message


def test_blocks_are_needed_by_a_setting_and_their_absence_says_where_to_point_them():
    with pytest.raises(ConfigError, match=r"Net has no `blocks`, which spec.trainer.activationCheckpointing needs"):
        model_contract.check_blocks(Net(), "spec.trainer.activationCheckpointing")
    net = Net()
    net.blocks = nn.ModuleList([nn.Linear(2, 2)])
    assert model_contract.check_blocks(net, "fsdp2") is net.blocks


def test_a_bug_in_forward_names_the_batch_it_got():
    error = model_contract.forward_failed(KeyError("labels"), Net(), {"tokens": torch.zeros(8, 65, dtype=torch.int64)})
    assert (
        str(error)
        == "spec.trainer.model: Net.forward raised KeyError on the first batch (tokens: [8, 65] int64): 'labels'"
    )
