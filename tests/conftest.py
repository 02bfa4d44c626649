"""Shared fixtures. tests/ is on sys.path so test-support modules (crd_server) import directly."""

import copy
import glob
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, os.path.dirname(__file__))

import kube_cluster  # noqa: E402  (needs tests/ on sys.path)

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "manifests" / "examples").glob("*.yaml"))
PYTORCHJOB_CRD = REPO / kube_cluster.PYTORCHJOB_CRD


@pytest.fixture(autouse=True)
def node_memory_left_clean():
    """Trainers a test kills leave their checkpoint copy in /dev/shm (in a pod, the pod's volume goes with it):
    what a test's runs left there goes when it ends."""
    from trainingrun_api import contract

    pattern = contract.memory_tier_dir("*", "*")
    before = set(glob.glob(pattern))
    yield
    for left in set(glob.glob(pattern)) - before:
        shutil.rmtree(left, ignore_errors=True)


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


@pytest.fixture(scope="session")
def kube_cluster_session(tmp_path_factory) -> "kube_cluster.ControlPlane":
    """A real control plane (etcd, kube-apiserver, kube-controller-manager) for the whole session.

    Needs the binaries in $KUBEBUILDER_ASSETS; without them the real-API tests skip with one line saying
    how to get them, except under TRAININGRUN_CI, where the tier must run and a missing binary fails.
    Tests isolate themselves by namespace (fixture `kube_namespace`)."""
    assets = os.environ.get(kube_cluster.ASSETS_ENV)
    missing = kube_cluster.missing_binaries(assets)
    if missing:
        message = f"real-API tier: missing {', '.join(missing)}; {kube_cluster.HOW_TO_GET}"
        if os.environ.get("TRAININGRUN_CI"):
            pytest.fail(message)
        pytest.skip(message)
    plane = kube_cluster.ControlPlane(Path(assets), tmp_path_factory.mktemp("kube-cluster"))
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def kube_cluster_with_crds(kube_cluster_session) -> "kube_cluster.ControlPlane":
    """The control plane with the project's CRDs and Kubeflow's PyTorchJob CRD installed, as a user would
    (`kubectl apply --server-side`)."""
    return kube_cluster_session.install_crds()


@pytest.fixture
def kube_namespace(kube_cluster_session, request) -> str:
    """A fresh namespace per test (deleted afterwards without waiting)."""
    import re
    import uuid

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:6]
    kube_cluster_session.create_namespace(name)
    yield name
    kube_cluster_session.kubectl("delete", "namespace", name, "--wait=false", check=False)
