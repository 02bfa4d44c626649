"""The user's journey on a real single-node Kubernetes, end to end (`make e2e`; marker `e2e`).

A real control plane and node (tests/kube_cluster.py, tests/kube_node.py), the real Kubeflow Training
Operator v1.9.0 controller with its webhook (its standalone manifests from ../shared/k8s), our chart
installed with `helm install` from the images scripts/build-images.sh built (imported as OCI archives
by scripts/e2e-images.sh), and moto's S3 server on the node's address for checkpoints. Then what a
user does: `kubectl apply -f` a 2-pod CPU TrainingRun, watch `kubectl get tr`, and lose pods the
ways pods are lost: worker-0 (the rendezvous host) deleted, worker-1 deleted, worker-1 evicted.
Each run must end Succeeded having lost no more than the steps since its last checkpoint, with the
same model (digest) as an uninterrupted `trainingrun local` run of the same file.

Needs root and the node's packages (scripts/install-node.sh) and the image archives; it skips saying
how to get them, except under TRAININGRUN_CI, where it must run.
"""
from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import yaml

import kube_cluster
import kube_node
from storage_servers import StorageServer, moto_s3
from trainingrun_operator import builders
from trainingrun_trainer.checkpoint import CheckpointStore

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "trainingrun-operator"
IMAGES = Path(os.environ.get("TRAININGRUN_E2E_IMAGES", REPO / ".tools" / "e2e-images"))
KUBEFLOW_MANIFEST = Path(os.environ.get(
    "TRAININGRUN_KUBEFLOW_MANIFEST", REPO.parent / "shared" / "k8s" / "recipe" / "tests" / "training-operator-standalone.yaml"))
HELM = Path(os.environ.get("HELM", REPO / ".tools" / "bin" / "helm"))
VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
OPERATOR_NAMESPACE = "trainingrun-system"
#: Bounds a broken test's wait; never a synchronisation device.
DEADLINE_S = 300.0
CHECKPOINT_STEPS = 40

#: The user's file: 2 pods of 1 process each (CPU, gloo), checkpoints every 40 steps to S3, sized so a
#: pod can be deleted mid-run on a 2-core machine; deterministic so its model can be compared.
RUN_FILE = {
    "apiVersion": "trainingrun.dev/v1alpha1",
    "kind": "TrainingRun",
    "metadata": {"name": "journey"},
    "spec": {
        "trainer": {
            "model": {"classPath": "trainingrun_trainer.models.CharTransformer",
                      "initArgs": {"dim": 32, "layers": 2, "heads": 2, "contextLength": 32}},
            "data": {"dataset": {"classPath": "trainingrun_trainer.data.SyntheticText",
                                 "initArgs": {"numSamples": 20000, "contextLength": 32}}, "batchSize": 8},
            "maxSteps": 400,
            "deterministic": True,
            "logIntervalSteps": 10,
        },
        "checkpoint": {"uri": "s3://BUCKET/runs/journey", "interval": {"steps": CHECKPOINT_STEPS}},
        "replicas": {"min": 2, "max": 2},
        "resources": {"cpu": "500m", "memory": "1Gi"},
        "secrets": {"s3Credentials": {"secretName": "s3-trainer"}},
        "recovery": {"backoffSeconds": 1},
    },
}


def missing() -> list[str]:
    assets = os.environ.get(kube_cluster.ASSETS_ENV)
    gaps = kube_cluster.missing_binaries(assets) + kube_node.missing_for_node(assets)
    if not (IMAGES / "images.txt").exists():
        gaps.append(f"image archives in {IMAGES} (bash scripts/build-images.sh && bash scripts/e2e-images.sh)")
    if not KUBEFLOW_MANIFEST.exists():
        gaps.append(f"Kubeflow's standalone manifests at {KUBEFLOW_MANIFEST}")
    if not os.access(HELM, os.X_OK):
        gaps.append(f"helm at {HELM} (bash scripts/install-helm.sh)")
    return gaps


class Cluster:
    """The cluster as the tests use it: the control plane, the node, and the S3 server for checkpoints."""

    def __init__(self, plane: kube_cluster.ControlPlane, node: kube_node.Node, s3: StorageServer):
        self.plane, self.node, self.s3 = plane, node, s3

    def kubectl(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess:
        return self.plane.kubectl(*args, **kwargs)

    def get(self, path: str) -> dict[str, Any]:
        code, answer = self.plane.request("GET", path)
        return answer if code == 200 else {}

    def run(self, namespace: str, name: str) -> dict[str, Any]:
        return self.get(f"/apis/trainingrun.dev/v1alpha1/namespaces/{namespace}/trainingruns/{name}")

    def wait(self, what: str, condition: Callable[[], Any], deadline_s: float = DEADLINE_S,
             explain: Callable[[], str] = lambda: "") -> Any:
        deadline = time.monotonic() + deadline_s
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {deadline_s:.0f} s\n{explain()}")
            time.sleep(0.5)  # polling the API, not a guess at how long it takes

    def diagnose(self, namespace: str) -> str:
        parts = [self.kubectl("-n", namespace, "get", "trainingruns,pytorchjobs,pods", "-o", "wide",
                              check=False).stdout,
                 self.kubectl("-n", namespace, "get", "events", "--sort-by=.lastTimestamp", check=False).stdout[-3000:],
                 self.kubectl("-n", OPERATOR_NAMESPACE, "logs", "deploy/trainingrun-operator", "--tail=40",
                              check=False).stdout]
        for pod in self.kubectl("-n", namespace, "get", "pods", "-o", "name", check=False).stdout.split():
            parts.append(f"--- {pod}\n" + self.kubectl("-n", namespace, "logs", pod, "--tail=25", check=False).stdout)
        return "\n".join(parts)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    gaps = missing()
    if gaps:
        message = "end-to-end tier: missing " + "; ".join(gaps) + f"; {kube_node.HOW_TO_GET}"
        if os.environ.get("TRAININGRUN_CI"):
            pytest.fail(message)
        pytest.skip(message)
    workdir = tmp_path_factory.mktemp("e2e")
    plane = kube_cluster.ControlPlane(Path(os.environ[kube_cluster.ASSETS_ENV]), workdir / "plane",
                                      node=(kube_node.NODE_NAME, kube_node.NODE_IP))
    node = kube_node.Node(plane, workdir / "node")
    try:
        plane.start()
        node.start()
        for line in (IMAGES / "images.txt").read_text().splitlines():
            name, archive = line.split()
            node.import_image(IMAGES / archive, name)
        install_kubeflow(plane)
        with moto_s3(kube_node.NODE_IP) as s3:
            yield Cluster(plane, node, s3)
    finally:
        node.stop()
        plane.stop()


def install_kubeflow(plane: kube_cluster.ControlPlane) -> None:
    """Kubeflow's standalone overlay, as its README installs it, and wait until its webhook answers."""
    plane.kubectl("apply", "--server-side", "-f", str(KUBEFLOW_MANIFEST))
    plane.kubectl("-n", "kubeflow", "rollout", "status", "deploy/training-operator", "--timeout=180s")
    probe = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "probe", "namespace": "default"},
             "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 1, "template": {"spec": {"containers": [
                 {"name": "pytorch", "image": "localhost/k8s-test/pause:3.10"}]}}}}}}
    deadline = time.monotonic() + 120
    while plane.request("POST", "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs?dryRun=All", probe)[0] != 201:
        assert time.monotonic() < deadline, "Kubeflow's webhook never answered"
        time.sleep(0.5)  # polling the webhook


def helm(*args: str, kubeconfig: Path) -> subprocess.CompletedProcess:
    result = subprocess.run([str(HELM), f"--kubeconfig={kubeconfig}", *args], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def installed(cluster: Cluster) -> Iterator[Cluster]:
    """Our chart, installed as the README says (images pointed at the local ones)."""
    helm("install", "trainingrun", str(CHART), "--namespace", OPERATOR_NAMESPACE, "--create-namespace",
         "--set", "image.repository=localhost/trainingrun-operator", "--set", f"image.tag={VERSION}",
         "--set", "image.pullPolicy=Never", "--set", f"trainer.image=localhost/trainingrun-trainer:{VERSION}",
         "--wait", "--timeout=180s", kubeconfig=cluster.plane.admin_kubeconfig)
    yield cluster


def run_file(bucket: str, name: str) -> dict[str, Any]:
    document = copy.deepcopy(RUN_FILE)
    document["metadata"]["name"] = name
    document["spec"]["checkpoint"]["uri"] = f"s3://{bucket}/runs/{name}"
    return document


@pytest.fixture(scope="module")
def reference_digest(tmp_path_factory) -> str:
    """The model digest of the same file run uninterrupted with `trainingrun local` (2 processes)."""
    folder = tmp_path_factory.mktemp("local")
    document = run_file("unused", "journey")
    del document["spec"]["secrets"]
    path = folder / "trainingrun.yaml"
    path.write_text(yaml.safe_dump(document))
    uri = f"file://{folder}/checkpoints"
    local = subprocess.run([str(Path(sys.executable).parent / "trainingrun"), "local", str(path), "--nproc", "2",
                            "--checkpoint-uri", uri], capture_output=True, text=True, timeout=900, cwd=folder)
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    final = {i.step: i for i in CheckpointStore(uri).list()}[RUN_FILE["spec"]["trainer"]["maxSteps"]]
    assert final.valid
    return final.model_digest


def step_of(run: dict[str, Any]) -> int:
    return ((run.get("status") or {}).get("progress") or {}).get("step") or 0


def condition(run: dict[str, Any], kind: str) -> Optional[dict[str, Any]]:
    return next((c for c in (run.get("status") or {}).get("conditions") or [] if c["type"] == kind), None)


def delete_pod(cluster: Cluster, namespace: str, pod: str) -> None:
    cluster.kubectl("-n", namespace, "delete", "pod", pod, "--wait=false")


def evict_pod(cluster: Cluster, namespace: str, pod: str) -> None:
    code, answer = cluster.plane.request("POST", f"/api/v1/namespaces/{namespace}/pods/{pod}/eviction", {
        "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": namespace}})
    assert code == 201, answer


LOSSES = {
    "delete-worker-0": (0, delete_pod),
    "delete-worker-1": (1, delete_pod),
    "evict-worker-1": (1, evict_pod),
}


@pytest.mark.parametrize("loss", list(LOSSES))
def test_a_lost_pod_costs_at_most_the_steps_since_the_last_checkpoint(installed, reference_digest, loss):
    cluster = installed
    index, lose = LOSSES[loss]
    namespace = cluster.plane.create_namespace(f"{loss}-{uuid.uuid4().hex[:6]}")
    bucket = cluster.s3.new_bucket()
    name = "journey"
    explain = lambda: cluster.diagnose(namespace)  # noqa: E731
    path = Path(cluster.plane.workdir) / f"{namespace}.yaml"
    path.write_text(yaml.safe_dump(run_file(bucket, name)))
    cluster.kubectl("-n", namespace, "apply", "-f", str(path))
    if loss == "delete-worker-0":
        # The Secret it names comes after the run: the run says so, then starts once it exists.
        missing_secret = cluster.wait("condition SecretMissing", lambda: condition(cluster.run(namespace, name),
                                                                                    "SecretMissing"), explain=explain)
        assert "s3-trainer" in missing_secret["message"], missing_secret
    cluster.kubectl("-n", namespace, "create", "secret", "generic", "s3-trainer",
                    "--from-literal=AWS_ACCESS_KEY_ID=testing", "--from-literal=AWS_SECRET_ACCESS_KEY=testing")

    # `kubectl get tr` shows it Running with the step moving.
    cluster.wait("a committed checkpoint", lambda: (cluster.run(namespace, name).get("status") or {}).get(
        "lastGoodCheckpoint"), explain=explain)
    table = cluster.kubectl("-n", namespace, "get", "tr", name).stdout
    assert re.search(rf"^{name}\s+Running\s+\d+", table, re.M), table
    first = step_of(cluster.run(namespace, name))
    cluster.wait("the step moving", lambda: step_of(cluster.run(namespace, name)) > first, explain=explain)

    before = cluster.run(namespace, name)["status"]
    committed_before = before["lastGoodCheckpoint"]["step"]
    job = before["jobName"]
    pod = f"{job}-worker-{index}"
    lose(cluster, namespace, pod)
    deleted_at = time.monotonic()

    done = cluster.wait("Succeeded", lambda: (cluster.run(namespace, name).get("status") or {}).get("phase") in (
        "Succeeded", "Failed") and cluster.run(namespace, name), explain=explain)
    assert done["status"]["phase"] == "Succeeded", explain()
    logs = "\n".join(cluster.kubectl("-n", namespace, "logs", p, check=False).stdout for p in
                     cluster.kubectl("-n", namespace, "get", "pods", "-o", "name").stdout.split())
    resumed = [int(s) for s in re.findall(r"resumed from s3://\S+ at step (\d+)", logs)]
    assert resumed, f"no resume after the pod was lost:\n{explain()}"
    # Lost work: at most what was trained since the last checkpoint before the loss.
    assert min(resumed) >= committed_before, (resumed, committed_before)
    store = CheckpointStore(f"s3://{bucket}/runs/{name}", **cluster.s3.store_kwargs)
    final = {i.step: i for i in store.list()}[RUN_FILE["spec"]["trainer"]["maxSteps"]]
    assert final.valid and final.model_digest == reference_digest
    print(f"{loss}: resumed from {resumed} (committed {committed_before} before the loss); "
          f"succeeded {time.monotonic() - deleted_at:.1f} s after it")


def test_helm_uninstall_and_crd_removal_leave_nothing_behind(installed):
    cluster = installed
    helm("uninstall", "trainingrun", "--namespace", OPERATOR_NAMESPACE, "--wait", kubeconfig=cluster.plane.admin_kubeconfig)
    cluster.kubectl("delete", "-f", str(CHART / "crds"), "--wait=true", "--timeout=120s")
    leftovers = cluster.kubectl("get", "clusterroles,clusterrolebindings,crds", "-o", "name").stdout
    assert not re.search(r"trainingrun", leftovers), leftovers
    assert not cluster.kubectl("-n", OPERATOR_NAMESPACE, "get", "all,serviceaccounts,configmaps,roles,rolebindings",
                               "-l", "app.kubernetes.io/instance=trainingrun", "-o", "name").stdout.strip()
    assert not cluster.kubectl("get", "trainingruns.trainingrun.dev", "-A", check=False).stdout.strip()
