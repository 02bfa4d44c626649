"""Numeric precision: `32-true | 16-mixed | bf16-mixed | bf16-true`.

Mixed modes keep float32 weights and run forward/backward under autocast; `16-mixed` also needs a
GradScaler because fp16 gradients underflow. `bf16-true` casts the weights themselves to bfloat16.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager

import torch
from torch import nn

from trainingrun_api.config import Precision


@dataclass(frozen=True)
class PrecisionPlan:
    precision: Precision
    device_type: str

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(self.precision)

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16-true" else torch.float32

    def autocast(self) -> ContextManager:
        dtype = self.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """Enabled only for fp16; a disabled scaler is a no-op with the same interface and state."""
        return torch.amp.GradScaler(self.device_type, enabled=self.precision == "16-mixed")

    def prepare(self, model: nn.Module) -> nn.Module:
        return model.to(self.param_dtype)


def check_supported(precision: Precision, device_type: str) -> None:
    """Fail before any process group exists when the hardware cannot run the precision."""
    if precision == "16-mixed" and device_type != "cuda":
        raise ValueError(
            "spec.trainer.precision: 16-mixed needs a CUDA GPU (fp16 autocast with a grad scaler); "
            "on CPU use bf16-mixed or 32-true"
        )
    if precision in ("bf16-mixed", "bf16-true") and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"spec.trainer.precision: {precision} needs a GPU with bfloat16 support (Ampere or newer); "
            "use 16-mixed on this GPU"
        )
