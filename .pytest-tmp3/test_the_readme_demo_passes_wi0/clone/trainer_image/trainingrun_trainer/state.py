"""What the built-in trainer checkpoints: Stateful entries of one DCP state dict, plus each rank's own values.

The state dict (`Trainer._state`), one entry per component, as torchtitan keeps it:

    model       the unwrapped module's weights (sharded under FSDP2)       ModelState
    optim       the optimizer's state                                        OptimizerState
    ema         the EMA weights, when spec.trainer.ema is on                 WeightEMA
    scheduler   the LR schedule (its step count and scaled peak LR)          LambdaLR
    scaler      the fp16 grad scaler (empty when disabled)                   GradScaler
    sampler     the data position: epoch and samples consumed, by all ranks  ResumableSampler
    guard       the non-finite guard's counts                                NonFiniteGuard
    train       the step and the run that produced the weights               TrainState

These are the same on every rank, so DCP writes each once. What differs between ranks is `PerRank`: the RNG
streams, the loss this rank saw and the step time it measured; the checkpoint store keeps it as that rank's
own entry (`extra`), which a rank the checkpoint's world did not have finds missing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

#: The entries that only the optimizer step changes (and EMA's update after it): a checkpoint copies them in the
#: background while the next forward and backward pass run (`CheckpointStore.save`'s copy_in_background).
CHANGED_BY_OPTIMIZER_STEP = ("model", "optim", "ema")


def changed_by_forward(model: nn.Module) -> bool:
    """Whether a forward pass changes what the model's state dict holds: persistent buffers such as batch norm's
    running statistics (and DDP broadcasts buffers before each forward). A checkpoint's background copy of such a
    model must be done before the next forward pass, not only before the optimizer step."""
    parameters = {name for name, _ in model.named_parameters()}
    return any(name not in parameters for name in model.state_dict())


class ModelState:
    """A model's weights as a DCP Stateful (DCP calls state_dict() to save, load_state_dict() after a load)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state)


class OptimizerState:
    """An optimizer's state as a DCP Stateful, keyed by parameter names (so it reshards and survives wrapping)."""

    def __init__(self, model: nn.Module, optimizer: Any):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


@dataclass
class TrainState:
    """The loop's own counters."""

    step: int = 0  #: optimizer steps taken
    run_uid: str = ""  #: the TrainingRun (metadata.uid) whose steps produced these weights

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.run_uid = int(state["step"]), str(state["run_uid"])


@dataclass
class PerRank:
    """One rank's own values, saved by each rank (the store's `extra`)."""

    rng: dict[str, Any]  #: python, numpy, torch (and CUDA) RNG states: seeding.rng_state()
    world_size: int  #: RNG streams are per rank: they carry over only to the same world size
    loss: Optional[float] = None  #: this rank's loss at the last step
    productive_seconds: float = (
        0.0  #: step time (data wait excluded) this rank measured, summed over attempts of the same run
    )

    def as_extra(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> "PerRank":
        return cls(
            rng=extra["rng"],
            world_size=int(extra["world_size"]),
            loss=extra.get("loss"),
            productive_seconds=float(extra.get("productive_seconds") or 0.0),
        )
