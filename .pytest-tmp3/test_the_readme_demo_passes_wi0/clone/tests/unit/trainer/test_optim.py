"""Weight-decay groups and LR schedules."""

import copy
import math

import pytest
import torch
from torch import nn

from trainingrun_api.config import OptimizerConfig, ScheduleConfig
from trainingrun_trainer.optim import (
    build_optimizer,
    build_scheduler,
    lr_factor,
    scale_learning_rate,
    skips_on_device,
    step_unless,
)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.linear = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


def test_decay_only_matrices():
    model = Tiny()
    optimizer = build_optimizer(model, OptimizerConfig(weight_decay=0.1))
    decayed, undecayed = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and undecayed["weight_decay"] == 0.0
    assert [p is model.linear.weight for p in decayed["params"]] == [True]
    assert {id(p) for p in undecayed["params"]} == {
        id(model.embed.weight),
        id(model.linear.bias),
        id(model.norm.weight),
        id(model.norm.bias),
    }
    single = build_optimizer(model, OptimizerConfig(weight_decay=0.1, no_decay_for_bias_and_norm=False))
    assert len(single.param_groups) == 1
    assert isinstance(build_optimizer(model, OptimizerConfig(name="sgd")), torch.optim.SGD)


def factors(schedule, steps=100):
    return [lr_factor(s, schedule, steps) for s in range(steps)]


def test_warmup_is_linear_then_cosine_reaches_the_floor():
    f = factors(ScheduleConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1))
    assert f[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert f[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))  # decays monotonically
    assert lr_factor(100, ScheduleConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1), 100) == pytest.approx(0.1)


def test_warm_restarts_jump_back_up_with_growing_periods():
    f = factors(
        ScheduleConfig(name="cosine-warm-restarts", restart_period_steps=10, restart_period_mult=2, min_lr_ratio=0.0),
        70,
    )
    restarts = [i for i in range(1, 70) if f[i] > f[i - 1] + 0.5]
    assert restarts == [10, 30]  # periods 10, 20, 40
    assert f[0] == pytest.approx(1.0) and f[9] < 0.05


def test_inverse_sqrt_exponential_step_constant():
    inv = factors(ScheduleConfig(name="inverse-sqrt", warmup_steps=4), 40)
    assert inv[3] == pytest.approx(1.0) and inv[4 + 12] == pytest.approx(math.sqrt(4 / 16))
    exp = factors(ScheduleConfig(name="exponential", gamma=0.9), 5)
    assert exp == pytest.approx([0.9**i for i in range(5)])
    step = factors(ScheduleConfig(name="step", gamma=0.5, step_size=3), 7)
    assert step == pytest.approx([1, 1, 1, 0.5, 0.5, 0.5, 0.25])
    assert set(factors(ScheduleConfig(name="constant"))) == {1.0}


def test_scheduler_resumes_exactly():
    def make():
        model = Tiny()
        opt = build_optimizer(model, OptimizerConfig(lr=1.0))
        return opt, build_scheduler(opt, ScheduleConfig(name="cosine", warmup_steps=3), 20)

    opt, sched = make()
    lrs = []
    for _ in range(12):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    opt2, sched2 = make()
    for _ in range(5):
        opt2.step()
        sched2.step()
    saved = sched2.state_dict()
    opt3, sched3 = make()
    sched3.load_state_dict(saved)
    resumed = []
    for _ in range(7):
        opt3.step()
        sched3.step()
        resumed.append(sched3.get_last_lr()[0])
    assert resumed == pytest.approx(lrs[5:])


def test_scale_learning_rate_lowers_the_schedule_for_good():
    model = Tiny()
    opt = build_optimizer(model, OptimizerConfig(lr=1.0))
    sched = build_scheduler(opt, ScheduleConfig(name="constant"), 10)
    scale_learning_rate(sched, 0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.5]
    opt.step()
    sched.step()
    assert sched.get_last_lr() == [0.5, 0.5]


def test_optimizers_are_fused_unless_the_spec_says_not():
    model = nn.Linear(4, 4)
    assert build_optimizer(model, OptimizerConfig()).defaults["fused"]  # fused kernels run on CPUs too
    assert build_optimizer(model, OptimizerConfig(name="sgd")).defaults["fused"]
    assert not build_optimizer(model, OptimizerConfig(fused=False)).defaults.get("fused")
    assert not build_optimizer(model, OptimizerConfig(name="sgd", fused=False)).defaults.get("fused")


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_device_flag_skips_the_fused_step_leaving_parameters_and_moments_as_they_were(name):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = build_optimizer(model, OptimizerConfig(name=name, lr=0.1))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # SGD's momentum buffers exist from here on
    assert skips_on_device(optimizer)
    before = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    step_unless(optimizer, torch.tensor(1.0))
    after = (model.state_dict(), optimizer.state_dict())
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    for key, state in before[1]["state"].items():
        for field, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(after[1]["state"][key][field])), field
    assert not hasattr(optimizer, "found_inf") and not hasattr(optimizer, "grad_scale")
    step_unless(optimizer, torch.tensor(0.0))
    assert not torch.equal(before[0]["weight"], model.weight)


def test_only_an_optimizer_a_device_flag_can_skip_is_told_by_one():
    model = nn.Linear(4, 4)
    assert not skips_on_device(build_optimizer(model, OptimizerConfig(fused=False)))
    # Fused SGD with momentum makes uninitialised momentum buffers on its first step and trusts them after: a skipped
    # first step would leave garbage in them, so that one step is decided on the host.
    sgd = build_optimizer(model, OptimizerConfig(name="sgd"))
    assert not skips_on_device(sgd)
    assert skips_on_device(build_optimizer(model, OptimizerConfig(name="sgd", momentum=0.0)))
    model(torch.randn(2, 4)).sum().backward()
    sgd.step()
    assert skips_on_device(sgd)
