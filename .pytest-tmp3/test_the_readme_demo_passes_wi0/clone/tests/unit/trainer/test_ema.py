"""ema.WeightEMA: the float32 shadow follows decay * shadow + (1 - decay) * weights, skips frozen parameters, copies
back in the model's dtype, and refuses a checkpoint of another model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainingrun_trainer.ema import WeightEMA


def small_model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).to(dtype)
    model[1].bias.requires_grad_(False)
    return model


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5, 1.5])
def test_decay_outside_the_open_interval_is_refused(decay):
    with pytest.raises(ValueError, match="EMA decay must be in"):
        WeightEMA(small_model(), decay)


def test_the_shadow_follows_the_formula_and_leaves_frozen_parameters_out():
    model = small_model()
    ema = WeightEMA(model, decay=0.9)
    assert "1.bias" not in ema.shadow and "0.weight" in ema.shadow
    before = {name: t.clone() for name, t in ema.shadow.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)
    params = dict(model.named_parameters())
    for name, shadow in ema.shadow.items():
        assert torch.allclose(shadow, 0.9 * before[name] + 0.1 * params[name].detach())


def test_a_bfloat16_model_keeps_a_float32_shadow_and_gets_its_own_dtype_back():
    model = small_model(torch.bfloat16)
    ema = WeightEMA(model, decay=0.5)
    assert all(t.dtype == torch.float32 for t in ema.shadow.values())
    with torch.no_grad():
        for t in ema.shadow.values():
            t.fill_(0.25)
    ema.copy_to(model)
    assert model[0].weight.dtype == torch.bfloat16
    assert torch.equal(model[0].weight, torch.full_like(model[0].weight, 0.25))
    assert not torch.equal(model[1].bias, torch.full_like(model[1].bias, 0.25))  # frozen: not averaged


def test_state_round_trips_and_a_state_of_another_model_is_refused():
    model = small_model()
    ema = WeightEMA(model, decay=0.99)
    saved = {name: t.clone() + 1 for name, t in ema.state_dict().items()}
    other = WeightEMA(small_model(), decay=0.99)
    other.load_state_dict(saved)
    assert all(torch.equal(other.shadow[name], saved[name]) for name in saved)
    with pytest.raises(KeyError, match="another model"):
        other.load_state_dict({"0.weight": saved["0.weight"]})


def test_a_step_the_optimizer_skipped_leaves_the_shadow_as_it_was_and_one_it_took_follows_the_formula():
    model = small_model()
    told, untold = WeightEMA(model, decay=0.9), WeightEMA(model, decay=0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    before = {name: t.clone() for name, t in told.shadow.items()}
    told.update(model, skipped=torch.tensor(1.0))
    assert all(torch.equal(before[name], told.shadow[name]) for name in before)
    told.update(model, skipped=torch.tensor(0.0))
    untold.update(model)
    assert all(torch.equal(untold.shadow[name], told.shadow[name]) for name in before)  # bitwise the scalar weight's
    assert not torch.equal(before["0.weight"], told.shadow["0.weight"])
