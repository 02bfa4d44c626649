"""Shared fixtures. tests/ is on sys.path so test-support modules (crd_server) import directly."""
import copy
import os
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, os.path.dirname(__file__))

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "manifests" / "examples").glob("*.yaml"))
PYTORCHJOB_CRD = REPO / "tests" / "fixtures" / "kubeflow.org_pytorchjobs.v1.9.0.yaml"


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture
def minimal_body() -> dict:
    """The smallest valid TrainingRun document; tests change one thing each."""
    return copy.deepcopy(
        {
            "apiVersion": "trainingrun.dev/v1alpha1",
            "kind": "TrainingRun",
            "metadata": {"name": "demo", "namespace": "team-a", "uid": "3f1c2a9e-0000-4000-8000-000000000001"},
            "spec": {"checkpoint": {"uri": "s3://bucket/runs/demo"}},
        }
    )


@pytest.fixture(scope="session")
def pytorchjob_schema() -> dict:
    crd = yaml.safe_load(PYTORCHJOB_CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
