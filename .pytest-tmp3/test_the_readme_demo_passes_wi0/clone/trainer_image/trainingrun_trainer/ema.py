"""Exponential moving average of the model's weights, checkpointed with everything else."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .torch_internals import foreach_lerp_


class WeightEMA:
    """Keeps `shadow = decay * shadow + (1 - decay) * weights` in float32 after every optimizer step.

    The shadow is a plain dict of tensors (not a module) so it checkpoints through DCP like any state
    and costs no autograd bookkeeping. Under FSDP2 each rank keeps the EMA of its own shards.
    """

    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.shadow = {
            name: p.detach().to(torch.float32).clone() for name, p in model.named_parameters() if p.requires_grad
        }

    @torch.no_grad()
    def update(self, model: nn.Module, skipped: Optional[torch.Tensor] = None) -> None:
        """After an optimizer step; `skipped`: a device flag, nonzero when the optimizer skipped that step in its
        kernel (`optim.step_unless`), which leaves the shadow as it was (a weight of 0) without the host reading it."""
        params = [p for name, p in model.named_parameters() if name in self.shadow]
        shadows = [self.shadow[name] for name, p in model.named_parameters() if name in self.shadow]
        weights = [p.detach().to(torch.float32) for p in params]
        if skipped is None:
            foreach_lerp_(shadows, weights, 1.0 - self.decay)
        elif shadows:
            weight = (1.0 - self.decay) * (1.0 - skipped.to(shadows[0].device, torch.float32))
            foreach_lerp_(shadows, weights, [weight] * len(shadows))

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Load the averaged weights into `model` (e.g. an evaluation copy)."""
        for name, p in model.named_parameters():
            if name in self.shadow:
                p.copy_(self.shadow[name].to(p.dtype))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(self.shadow) - set(state)
        if missing:
            raise KeyError(f"EMA state lacks {sorted(missing)[:3]}...; the checkpoint is from another model")
        for name, tensor in self.shadow.items():
            tensor.copy_(state[name])
