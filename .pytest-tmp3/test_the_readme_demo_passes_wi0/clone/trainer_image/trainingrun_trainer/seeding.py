"""Seeding of everything, deterministic mode, and RNG state capture for exact resume."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int, rank: int = 0) -> None:
    """Seed python, numpy and torch (CPU and CUDA). Ranks get distinct streams from one seed."""
    stream = (seed + 1_000_003 * rank) % 2**32
    random.seed(stream)
    np.random.seed(stream)
    torch.manual_seed(stream)  # also seeds every CUDA device


def use_deterministic_algorithms(enabled: bool) -> None:
    """Bitwise-reproducible kernels; errors on ops that have no deterministic version."""
    if enabled:
        # cuBLAS needs a fixed workspace to be deterministic; must be set before the first CUDA call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(enabled, warn_only=False)


def rng_state() -> dict[str, Any]:
    """This process's RNG states, to be saved per rank."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
