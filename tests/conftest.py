"""Shared fixtures. tests/ is on sys.path so test-support modules (crd_server) import directly."""

import copy
import glob
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, os.path.dirname(__file__))

import kube_cluster  # noqa: E402  (needs tests/ on sys.path)

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "manifests" / "examples").glob("*.yaml"))
PYTORCHJOB_CRD = REPO / kube_cluster.PYTORCHJOB_CRD
JOBSET_CRD = REPO / kube_cluster.JOBSET_CRD


def pytest_configure(config):
    """This session's own folder in node memory for the trainers' checkpoint copies (contract.MEMORY_TIER_ROOT_ENV),
    inherited by every process a test starts: a test cleaning up removes only its own session's copies, never those
    of a session running beside it or of a user's `trainingrun local` run in /dev/shm."""
    import tempfile

    from trainingrun_api import contract

    if os.environ.get(contract.MEMORY_TIER_ROOT_ENV) or hasattr(config, "workerinput"):
        return  # chosen already (a session started by a test, or one named by the caller)
    parent = contract.MEMORY_TIER_ROOT if os.path.isdir(contract.MEMORY_TIER_ROOT) else None
    config._memory_tier_root = tempfile.mkdtemp(prefix="trainingrun-tests-", dir=parent)
    os.environ[contract.MEMORY_TIER_ROOT_ENV] = config._memory_tier_root
    # The processes the tests start (torchrun's agents, their workers, servers) make temporary folders of their own
    # (torchelastic_*, pymp-*) and leave them where a test kills them: in this session's folder, removed at its end,
    # so a test run leaves nothing behind in /tmp. pytest's own tmp_path stays where pytest keeps it (this process
    # read the temporary directory before: tempfile caches it): `make test` puts it in the clone's .pytest-tmp/.
    tempfile.gettempdir()
    config._started_at = time.time()
    config._temp_root = tempfile.mkdtemp(prefix="trainingrun-tests-tmp-")
    os.environ["TMPDIR"] = config._temp_root
    # W&B writes its debug logs and settings under the home folder unless told otherwise (~/.cache/wandb).
    for variable in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        os.environ.setdefault(variable, os.path.join(config._temp_root, variable.lower()))


def pytest_unconfigure(config):
    root = getattr(config, "_memory_tier_root", None)
    if root:
        shutil.rmtree(root, ignore_errors=True)
        from trainingrun_api import contract

        os.environ.pop(contract.MEMORY_TIER_ROOT_ENV, None)
    started = getattr(config, "_started_at", None)
    if started is not None:  # what the processes the tests SIGKILLed (resource trackers among them) left in /dev/shm
        from trainingrun_operator.local.processes import remove_orphaned_semaphores

        remove_orphaned_semaphores(made_before=time.time(), made_after=started)
    temp = getattr(config, "_temp_root", None)
    if temp:
        shutil.rmtree(temp, ignore_errors=True)
        os.environ.pop("TMPDIR", None)


#: Seconds each tier's tests took this session (setup, call and teardown), by the tier's folder.
_TIER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    tier = "/".join(report.nodeid.split("/")[:2])
    _TIER_SECONDS[tier] = _TIER_SECONDS.get(tier, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """One line: where this session's time went, by tier (docs/development.md keeps the figures of `make test`)."""
    if _TIER_SECONDS:
        tiers = sorted(_TIER_SECONDS.items(), key=lambda item: -item[1])
        terminalreporter.write_line("time by tier: " + ", ".join(f"{tier} {seconds:.0f} s" for tier, seconds in tiers))


@pytest.fixture(autouse=True)
def node_memory_left_clean():
    """Trainers a test kills leave their checkpoint copy in node memory (in a pod, the pod's volume goes with it):
    what a test's runs left in this session's folder goes when it ends."""
    from trainingrun_api import contract

    pattern = f"{contract.memory_tier_root()}/trainingrun-*-attempt-*"
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
def jobset_schema() -> dict:
    crd = yaml.safe_load(JOBSET_CRD.read_text())
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


@pytest.fixture(scope="session")
def jobset_controller(kube_cluster_with_crds, tmp_path_factory):
    """The real JobSet controller v0.9.1 and its webhooks beside the session's control plane (tests/jobset_controller.py):
    from then on every JobSet created, dry runs included, and every pod of one is admitted by its webhooks."""
    import jobset_controller as controller

    binary = Path(os.environ.get(kube_cluster.ASSETS_ENV, "")) / controller.BINARY
    if not binary.is_file():
        message = f"real-API tier: missing {controller.BINARY}; {kube_cluster.HOW_TO_GET}"
        if os.environ.get("TRAININGRUN_CI"):
            pytest.fail(message)
        pytest.skip(message)
    running = controller.started(kube_cluster_with_crds, tmp_path_factory.mktemp("jobset-controller"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def reference_digest(tmp_path_factory) -> str:
    """The end-to-end tier's reference model digest (kube_journey.reference_digest), computed once for both journeys."""
    import kube_journey

    return kube_journey.reference_digest(tmp_path_factory.mktemp("local"))


@pytest.fixture
def kube_namespace(kube_cluster_session, request) -> str:
    """A fresh namespace per test (deleted afterwards without waiting)."""
    import re
    import uuid

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:6]
    kube_cluster_session.create_namespace(name)
    yield name
    kube_cluster_session.kubectl("delete", "namespace", name, "--wait=false", check=False)
