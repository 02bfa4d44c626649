"""EMA, precision plans, seeding and the non-finite guard."""

import random

import numpy as np
import pytest
import torch
from torch import nn

from trainingrun_api.config import HealthConfig
from trainingrun_trainer.ema import WeightEMA
from trainingrun_trainer.health import NonFiniteGuard, Verdict
from trainingrun_trainer.precision import PrecisionPlan, check_supported
from trainingrun_trainer.seeding import rng_state, seed_everything, set_rng_state


def test_ema_tracks_weights_and_round_trips():
    model = nn.Linear(3, 2)
    ema = WeightEMA(model, decay=0.5)
    before = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(2.0)
    ema.update(model)
    assert torch.allclose(ema.shadow["weight"], before + 1.0)
    state = {k: v.clone() for k, v in ema.state_dict().items()}
    other = WeightEMA(nn.Linear(3, 2), decay=0.5)
    other.load_state_dict(state)
    target = nn.Linear(3, 2)
    other.copy_to(target)
    assert torch.equal(target.weight, state["weight"])
    with pytest.raises(KeyError, match="another model"):
        other.load_state_dict({"weight": state["weight"]})
    with pytest.raises(ValueError):
        WeightEMA(model, decay=1.0)


def test_precision_plans():
    assert PrecisionPlan("32-true", "cpu").autocast_dtype is None
    plan = PrecisionPlan("bf16-mixed", "cpu")
    with plan.autocast():
        out = nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16
    assert not plan.grad_scaler().is_enabled()
    assert PrecisionPlan("bf16-true", "cpu").prepare(nn.Linear(2, 2)).weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="16-mixed needs a CUDA GPU"):
        check_supported("16-mixed", "cpu")
    check_supported("bf16-mixed", "cpu")


def draw():
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_seeding_and_rng_state_round_trip():
    seed_everything(7, rank=0)
    a = draw()
    seed_everything(7, rank=0)
    assert draw() == a
    seed_everything(7, rank=1)
    assert draw() != a  # ranks get different streams
    seed_everything(7)
    draw()
    saved = rng_state()
    expected = draw()
    seed_everything(123)
    set_rng_state(saved)
    assert draw() == expected


def test_guard_skips_then_rolls_back_then_aborts():
    guard = NonFiniteGuard(HealthConfig(max_consecutive_non_finite=2, max_rollbacks=1))
    assert guard.observe(1, True, True) is Verdict.OK
    assert guard.observe(2, False, True) is Verdict.SKIP
    assert guard.observe(3, True, True) is Verdict.OK  # the streak resets
    assert guard.observe(4, False, True) is Verdict.SKIP
    assert guard.observe(5, True, False) is Verdict.ROLLBACK
    assert guard.observe(6, False, True) is Verdict.SKIP
    assert guard.observe(7, False, True) is Verdict.ABORT
    assert guard.skipped_total == 5
    message = guard.abort_message()
    assert "non-finite loss at step 7" in message and "maxRollbacks=1" in message
