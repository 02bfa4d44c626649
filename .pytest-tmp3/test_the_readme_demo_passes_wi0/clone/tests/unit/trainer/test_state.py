"""What the trainer checkpoints, and which of it a forward pass changes."""

import torch
from torch import nn

from trainingrun_trainer.models import CharTransformer, MaskedAutoencoder
from trainingrun_trainer.state import changed_by_forward


def test_a_forward_pass_changes_the_state_of_models_with_persistent_buffers_only():
    assert changed_by_forward(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))  # running statistics
    assert not changed_by_forward(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    with_a_scratch_buffer = nn.Linear(4, 4)
    with_a_scratch_buffer.register_buffer("mask", torch.ones(4, 4), persistent=False)  # not checkpointed
    assert not changed_by_forward(with_a_scratch_buffer)
    # The built-in models: their checkpointed weights change only in the optimizer step.
    assert not changed_by_forward(CharTransformer(vocab_size=16, dim=8, layers=1, heads=2, context_length=8))
    assert not changed_by_forward(
        MaskedAutoencoder(image_size=8, patch_size=4, dim=8, layers=1, heads=2, decoder_dim=8)
    )
