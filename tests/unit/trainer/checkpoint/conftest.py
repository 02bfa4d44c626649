"""The checkpoint tests' fixtures: `root`, a checkpoint directory below tmp_path, and `store`, a store over it."""

from pathlib import Path

import pytest

from trainingrun_trainer.checkpoint import CheckpointStore


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture
def store(root):
    with CheckpointStore(f"file://{root}", keep=10) as s:
        yield s
