"""Optimizer with weight-decay groups, and the learning-rate schedules of `spec.trainer.schedule`.

Schedules are pure functions of the step (`lr_factor`), wrapped in a LambdaLR, so a resumed run
gets exactly the LR an uninterrupted run would: the scheduler state is only its step count.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from trainingrun_api.config import OptimizerConfig, ScheduleConfig

_NORM_LAYERS = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.RMSNorm, nn.Embedding)


def parameter_groups(model: nn.Module, weight_decay: float, exclude_bias_and_norm: bool) -> list[dict]:
    """Decay matrices; leave biases, norm weights and embeddings undecayed when asked (standard practice)."""
    if not exclude_bias_and_norm:
        return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    no_decay_ids = {
        id(p)
        for module in model.modules()
        if isinstance(module, _NORM_LAYERS)
        for p in module.parameters(recurse=False)
    }
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or name.endswith(".bias") or id(param) in no_decay_ids:
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer of `config` over `model`'s parameter groups, fused unless `config.fused` is false: a fused
    optimizer skips a step whose gradients are not finite in its kernel (`skip_on_device`), so the host never waits
    for the device to decide."""
    groups = parameter_groups(model, config.weight_decay, config.no_decay_for_bias_and_norm)
    fused = {"fused": True} if config.fused is not False else {}
    if config.name == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps, **fused)
    return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum, **fused)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `step()` can be told to skip by a device tensor (`found_inf`, as GradScaler tells fused kernels) now.

    Fused SGD with momentum cannot before its first step: it makes its momentum buffers uninitialised and then
    trusts them, so a skipped first step would leave garbage in them."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if isinstance(optimizer, torch.optim.SGD):
        return all(
            group["momentum"] == 0 or optimizer.state.get(p, {}).get("momentum_buffer") is not None
            for group in optimizer.param_groups
            for p in group["params"]
        )
    return True


def step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """`optimizer.step()`, skipped in the kernel where `found_inf` (a float tensor on the parameters' device) is
    nonzero: the parameters, moments and step counts stay as they were. Only where `skips_on_device`."""
    # The attributes GradScaler sets for the same kernels (torch.amp.GradScaler.step), which mypy does not know of.
    told: Any = optimizer
    told.grad_scale, told.found_inf = None, found_inf
    try:
        optimizer.step()
    finally:
        del told.grad_scale, told.found_inf


def lr_factor(step: int, schedule: ScheduleConfig, max_steps: int) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based)."""
    warmup = schedule.warmup_steps
    if warmup and step < warmup:
        return (step + 1) / warmup
    after = step - warmup
    span = max(1, max_steps - warmup)
    floor = schedule.min_lr_ratio
    name = schedule.name
    if name == "constant":
        return 1.0
    if name == "cosine":
        progress = min(1.0, after / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if name == "cosine-warm-restarts":
        period, mult = schedule.restart_period_steps, schedule.restart_period_mult
        position = after
        while position >= period:
            position -= period
            period *= mult
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * position / period))
    if name == "inverse-sqrt":
        # Continuous with warmup: 1 at the end of warmup, then decays as 1/sqrt(step).
        return math.sqrt(max(1, warmup) / max(1, warmup + after))
    if name == "exponential":
        return schedule.gamma**after
    if name == "step":
        return schedule.gamma ** (after // schedule.step_size)
    raise ValueError(f"unknown schedule {name!r}")


def build_scheduler(
    optimizer: torch.optim.Optimizer, schedule: ScheduleConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, schedule, max_steps))


def scale_learning_rate(scheduler: torch.optim.lr_scheduler.LambdaLR, factor: float) -> None:
    """Lower the LR for good (after a rollback): scales the peak LR the schedule multiplies."""
    scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr * factor
