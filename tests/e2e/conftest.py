"""The end-to-end tier's shared fixtures: what both journeys (PyTorchJob, JobSet) compare their runs with."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kube_journey import RUN_FILE, run_file
from trainingrun_trainer.checkpoint import CheckpointStore


@pytest.fixture(scope="session")
def reference_digest(tmp_path_factory) -> str:
    """The model digest of the same file run uninterrupted with `trainingrun local` (2 processes)."""
    folder = tmp_path_factory.mktemp("local")
    document = run_file("unused", "journey")
    del document["spec"]["secrets"]
    path = folder / "trainingrun.yaml"
    path.write_text(yaml.safe_dump(document))
    uri = f"file://{folder}/checkpoints"
    local = subprocess.run(
        [str(Path(sys.executable).parent / "trainingrun"), "local", str(path), "--nproc", "2", "--checkpoint-uri", uri],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=folder,
    )
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    final = {i.step: i for i in CheckpointStore(uri).list()}[RUN_FILE["spec"]["trainer"]["maxSteps"]]
    assert final.valid
    return final.model_digest
