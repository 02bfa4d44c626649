"""seeding: one seed gives each rank its own reproducible stream, and the captured RNG state puts python, numpy and
torch back exactly where they were (what exact resume relies on)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from trainingrun_trainer import seeding


def draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_a_seed_and_rank_give_the_same_stream_and_ranks_differ():
    seeding.seed_everything(7, rank=0)
    first = draws()
    seeding.seed_everything(7, rank=0)
    assert draws() == first
    seeding.seed_everything(7, rank=1)
    assert all(a != b for a, b in zip(draws(), first))


def test_a_huge_seed_and_rank_wrap_into_what_numpy_takes():
    seeding.seed_everything(2**32 - 1, rank=4096)  # numpy refuses seeds >= 2**32


def test_the_captured_state_restores_every_generator():
    seeding.seed_everything(3)
    draws()
    state = seeding.rng_state()
    expected = draws()
    seeding.seed_everything(99)
    seeding.set_rng_state(state)
    assert draws() == expected


@pytest.fixture
def deterministic_mode_restored():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def test_deterministic_mode_is_switched_on_and_off(deterministic_mode_restored, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seeding.use_deterministic_algorithms(True)
    assert torch.are_deterministic_algorithms_enabled()
    import os

    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    seeding.use_deterministic_algorithms(False)
    assert not torch.are_deterministic_algorithms_enabled()
