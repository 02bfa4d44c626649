"""What the built-in trainer asks of a model (`spec.trainer.model`), checked where it is cheap and early.

The contract: `forward(batch)` takes the data's batch (`{"tokens": [B, T+1]}` for the text datasets, the dataset's
own dict otherwise) and returns the loss, a scalar tensor the backward pass starts from; `blocks`, an
`nn.ModuleList` of the model's repeated layers, when `activationCheckpointing` wraps them or FSDP2 shards them.
A model that breaks it is named at once, in one line that says what it returned and the fix, as a configuration error
(exit 2, not retried): on main each mistake ended as "the trainer exited with 1" after three in-place restarts, its
cause only in the attempt's log. docs/training.md shows a 10-line wrapper for a Hugging Face causal LM.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainingrun_api.model_base import ConfigError

FIELD = "spec.trainer.model"
#: Errors that a model's forward raises on its first batch from a bug of its own (the same on every try), not from
#: the machine (out of memory, a lost peer): a configuration error, not retried.
CODE_ERRORS = (TypeError, AttributeError, KeyError, IndexError, ValueError, NameError, AssertionError)


def check_blocks(model: nn.Module, needed_by: str) -> Any:
    """The model's `blocks` (its repeated layers), which `needed_by` (a setting) needs; ConfigError without them."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, (nn.ModuleList, nn.Sequential)) and len(blocks) > 0:
        return blocks
    found = "has no `blocks`" if blocks is None else f"has `blocks` of type {type(blocks).__name__}"
    raise ConfigError(
        f"{FIELD}: {type(model).__name__} {found}, which {needed_by} needs: set `self.blocks` to the nn.ModuleList of "
        "its repeated layers (a Hugging Face GPT-2: `self.blocks = self.model.transformer.h`; Llama: "
        f"`self.model.model.layers`), or turn {needed_by} off"
    )


def check_loss(output: Any, model: nn.Module) -> None:
    """The first forward's output is the loss: a scalar floating tensor that requires grad. ConfigError naming what
    it is and the fix otherwise."""
    name = type(model).__name__
    if isinstance(output, torch.Tensor):
        if output.numel() != 1:
            raise ConfigError(
                f"{FIELD}: {name}.forward returned a tensor of shape {list(output.shape)} (logits?), not the loss: "
                "compute the loss in forward and return it as a scalar (for example cross_entropy of the logits "
                "against the batch's next tokens)"
            )
        if not output.is_floating_point():
            raise ConfigError(f"{FIELD}: {name}.forward returned a {output.dtype} scalar: return the loss as a float")
        if not output.requires_grad:
            raise ConfigError(
                f"{FIELD}: {name}.forward returned a loss that does not require grad (computed under torch.no_grad, "
                "or detached with .item()/.detach()): return the tensor the backward pass can start from"
            )
        return
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) or (loss is None and (isinstance(output, dict) or hasattr(output, "logits"))):
        raise ConfigError(
            f"{FIELD}: {name}.forward returned a {type(output).__name__}, not the loss: return `.loss` of it"
            + ("" if loss is not None else " (it has none: pass `labels` so the model computes one)")
        )
    raise ConfigError(
        f"{FIELD}: {name}.forward returned a {type(output).__name__}, not the loss: return the loss as a scalar tensor"
    )


def forward_failed(error: BaseException, model: nn.Module, batch: Any) -> ConfigError:
    """A bug in the model's forward on its first batch, as a configuration error naming the model and the batch."""
    return ConfigError(
        f"{FIELD}: {type(model).__name__}.forward raised {type(error).__name__} on the first batch "
        f"({describe_batch(batch)}): {str(error).splitlines()[0][:300] if str(error) else ''}"
    )


def describe_batch(batch: Any) -> str:
    """`tokens: [8, 65] int64`: what a forward was given."""
    if isinstance(batch, dict):
        return ", ".join(f"{key}: {describe_batch(value)}" for key, value in list(batch.items())[:8])
    if isinstance(batch, torch.Tensor):
        return f"{list(batch.shape)} {str(batch.dtype).replace('torch.', '')}"
    return type(batch).__name__
