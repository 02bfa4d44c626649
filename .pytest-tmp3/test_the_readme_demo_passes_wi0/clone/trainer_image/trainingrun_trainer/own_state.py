"""What a loop of its own gives `Run.save` and `Run.resume`: its model and optimizer themselves, or state dicts.

A model (`nn.Module`, DDP- or FSDP2-wrapped too) and an optimizer in the state are converted here with
torch.distributed.checkpoint.state_dict (`get_state_dict`: keys by parameter name, the optimizer's state made in full
even before its first step, sharded states as DCP reshards them) and, after a resume, loaded back into the objects
(`set_state_dict`). Converting by hand was where resumes went silently wrong: `optimizer.state_dict()` before the
first step is empty, so a resume into it loaded no optimizer state at all, and its keys (parameter indices) are not
get_state_dict's (parameter names), so a checkpoint saved one way could not be read the other.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from trainingrun_api.model_base import ConfigError


class OwnState:
    """`state` as the checkpoint store saves and loads it (`plain`), its model and optimizer converted; `apply` loads
    a resumed `plain` back into them."""

    def __init__(self, state: Mapping[str, Any]):
        models = [key for key, value in state.items() if isinstance(value, nn.Module)]
        optimizers = [key for key, value in state.items() if isinstance(value, Optimizer)]
        if len(models) > 1 or len(optimizers) > 1 or (optimizers and not models):
            raise ConfigError(
                f"state: pass one model and at most one optimizer as objects (got models {models} and optimizers "
                f"{optimizers}); give any others as state dicts of your own"
            )
        self.model: Optional[tuple[str, nn.Module]] = (models[0], state[models[0]]) if models else None
        self.optimizer: Optional[tuple[str, Optimizer]] = (optimizers[0], state[optimizers[0]]) if optimizers else None
        self.plain = dict(state)
        if self.model is not None:
            model_state, optimizer_state = get_state_dict(self.model[1], self._optimizers())
            self.plain[self.model[0]] = model_state
            if self.optimizer is not None:
                self.plain[self.optimizer[0]] = optimizer_state

    def _optimizers(self) -> list[Optimizer]:
        return [self.optimizer[1]] if self.optimizer is not None else []

    def apply(self, into: dict[str, Any]) -> None:
        """After a resume into `plain`: the model and optimizer loaded from it, and every other entry of `into` (the
        caller's state) given what was loaded for it, as a load into `into` itself would have."""
        converted = {pair[0] for pair in (self.model, self.optimizer) if pair is not None}
        if self.model is not None:
            set_state_dict(
                self.model[1],
                self._optimizers(),
                model_state_dict=self.plain[self.model[0]],
                optim_state_dict=self.plain[self.optimizer[0]] if self.optimizer is not None else {},
            )
        for key in into:
            if key not in converted:
                into[key] = self.plain[key]
