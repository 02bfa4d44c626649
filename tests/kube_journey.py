"""The end-to-end tier's cluster (tests/e2e/, benchmarks/cluster_recovery.py): a real control plane and
node (tests/kube_cluster.py, tests/kube_node.py), the images of scripts/e2e-images.sh imported into the
node, the real Kubeflow Training Operator v1.9.0 with its webhook (its standalone manifests from
../shared/k8s) or, for the JobSet backend, the real JobSet controller v0.9.1 with its webhooks and no Kubeflow
(its upstream manifests from ../shared/k8s), our chart installed with `helm install` as the README says, and moto's
S3 server on the node's address for checkpoints.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import yaml

import kube_cluster
import kube_node
from storage_servers import StorageServer, moto_s3

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "trainingrun-operator"
IMAGES = Path(os.environ.get("TRAININGRUN_E2E_IMAGES", REPO / ".tools" / "e2e-images"))
KUBEFLOW_MANIFEST = Path(
    os.environ.get(
        "TRAININGRUN_KUBEFLOW_MANIFEST",
        REPO.parent / "shared" / "k8s" / "recipe" / "tests" / "training-operator-standalone.yaml",
    )
)
JOBSET_MANIFEST = Path(
    os.environ.get(
        "TRAININGRUN_JOBSET_MANIFEST",
        REPO.parent / "shared" / "k8s" / "recipe" / "jobset" / "jobset-v0.9.1-in-cluster.yaml",
    )
)
HELM = Path(os.environ.get("HELM", REPO / ".tools" / "bin" / "helm"))
VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
OPERATOR_NAMESPACE = "trainingrun-system"
#: Bounds a broken wait; never a synchronisation device.
DEADLINE_S = 300.0
CHECKPOINT_STEPS = 200

#: The user's file: 2 pods of 1 process each (CPU, gloo), checkpoints every 200 steps to S3; about a
#: minute of training on a 2-core machine, so that a pod is lost mid-run after rank 0 has reported
#: twice (it reports at most every 10 s); deterministic so its model can be compared.
RUN_FILE = {
    "apiVersion": "trainingrun.dev/v1alpha1",
    "kind": "TrainingRun",
    "metadata": {"name": "journey"},
    "spec": {
        "trainer": {
            "model": {
                "classPath": "trainingrun_trainer.models.CharTransformer",
                "initArgs": {"dim": 32, "layers": 2, "heads": 2, "contextLength": 32},
            },
            "data": {
                "dataset": {
                    "classPath": "trainingrun_trainer.data.SyntheticText",
                    "initArgs": {"numSamples": 20000, "contextLength": 32},
                },
                "batchSize": 8,
            },
            "maxSteps": 3000,
            "deterministic": True,
            "logIntervalSteps": 50,
        },
        "checkpoint": {"uri": "s3://BUCKET/runs/journey", "interval": {"steps": CHECKPOINT_STEPS}},
        "replicas": {"min": 2, "max": 2},
        "resources": {"cpu": "500m", "memory": "1Gi"},
        "secrets": {"s3Credentials": {"secretName": "s3-trainer"}},
        "recovery": {"backoffSeconds": 1},
    },
}


def run_file(bucket: str, name: str, endpoint_url: Optional[str] = None) -> dict[str, Any]:
    """RUN_FILE named `name`, checkpointing to s3://BUCKET/runs/NAME (at `endpoint_url`)."""
    document = copy.deepcopy(RUN_FILE)
    document["metadata"]["name"] = name
    document["spec"]["checkpoint"]["uri"] = f"s3://{bucket}/runs/{name}"
    if endpoint_url:
        document["spec"]["checkpoint"]["endpointUrl"] = endpoint_url
    return document


def missing() -> list[str]:
    assets = os.environ.get(kube_cluster.ASSETS_ENV)
    gaps = kube_cluster.missing_binaries(assets) + kube_node.missing_for_node(assets)
    if not (IMAGES / "images.txt").exists():
        gaps.append(f"image archives in {IMAGES} (bash scripts/build-images.sh && bash scripts/e2e-images.sh)")
    if not KUBEFLOW_MANIFEST.exists():
        gaps.append(f"Kubeflow's standalone manifests at {KUBEFLOW_MANIFEST}")
    if not JOBSET_MANIFEST.exists():
        gaps.append(f"JobSet's manifests at {JOBSET_MANIFEST}")
    if not shutil.which("prometheus"):
        gaps.append("prometheus (Debian's 'prometheus' package)")
    if not os.access(HELM, os.X_OK):
        gaps.append(f"helm at {HELM} (bash scripts/install-helm.sh)")
    return gaps


def require_the_cluster_tier() -> None:
    """For a test of this tier: skip, saying how to get what is missing (fail under TRAININGRUN_CI, where this tier
    must run)."""
    import pytest

    gaps = missing()
    if gaps:
        message = "end-to-end tier: missing " + "; ".join(gaps) + f"; {kube_node.HOW_TO_GET}"
        if os.environ.get("TRAININGRUN_CI"):
            pytest.fail(message)
        pytest.skip(message)


class Cluster:
    """The cluster as the tests use it: the control plane, the node, and the S3 server for checkpoints."""

    def __init__(
        self, plane: kube_cluster.ControlPlane, node: kube_node.Node, s3: StorageServer, backend: str = "PyTorchJob"
    ):
        self.plane, self.node, self.s3, self.backend = plane, node, s3, backend

    @property
    def jobs(self) -> str:
        """The kinds of the attempts' jobs, as kubectl names them."""
        return {"PyTorchJob": "pytorchjobs", "JobSet": "jobsets,jobs"}.get(self.backend, "pytorchjobs,jobsets,jobs")

    def worker_pods(self, namespace: str, name: str, attempt: int, index: int) -> list[dict[str, Any]]:
        """Worker `index`'s pods of an attempt, oldest first, by their labels (either backend's index label): Kubeflow
        names the pod `<job>-worker-<index>`, a JobSet's Job `<job>-worker-0-<index>-<random>`, a new name for a
        replacement."""
        found = []
        for index_label in ("training.kubeflow.org/replica-index", "batch.kubernetes.io/job-completion-index"):
            selector = f"trainingrun.dev/run={name},trainingrun.dev/attempt={attempt},{index_label}={index}"
            code, answer = self.plane.request(
                "GET", f"/api/v1/namespaces/{namespace}/pods?" + urllib.parse.urlencode({"labelSelector": selector})
            )
            assert code == 200, answer
            found += answer["items"]
        return sorted(found, key=lambda p: p["metadata"]["creationTimestamp"])

    def worker_pod(self, namespace: str, name: str, attempt: int, index: int) -> str:
        """The name of worker `index`'s pod of an attempt now (not one being deleted)."""
        pods = [
            p for p in self.worker_pods(namespace, name, attempt, index) if not p["metadata"].get("deletionTimestamp")
        ]
        assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
        return pods[0]["metadata"]["name"]

    def kubectl(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess:
        return self.plane.kubectl(*args, **kwargs)

    def get(self, path: str) -> dict[str, Any]:
        code, answer = self.plane.request("GET", path)
        return answer if code == 200 else {}

    def run(self, namespace: str, name: str) -> dict[str, Any]:
        return self.get(f"/apis/trainingrun.dev/v1alpha1/namespaces/{namespace}/trainingruns/{name}")

    @contextlib.contextmanager
    def namespace(self, prefix: str) -> Iterator[str]:
        """A fresh namespace for one test, emptied afterwards whether the test passed or not: a failed test's
        running trainer pods would hold the node's CPU and leave the next test's pods Pending (seen in CI)."""
        name = self.plane.create_namespace(f"{prefix}-{uuid.uuid4().hex[:6]}")
        try:
            yield name
        finally:
            # A terminating namespace admits no new pods, so Kubeflow cannot replace the ones deleted here.
            self.kubectl("delete", "namespace", name, "--wait=false", check=False)
            self.kubectl(
                "-n", name, "delete", "pods", "--all", "--grace-period=1", "--wait=true", "--timeout=100s", check=False
            )

    def wait(
        self,
        what: str,
        condition: Callable[[], Any],
        deadline_s: float = DEADLINE_S,
        explain: Callable[[], str] = lambda: "",
    ) -> Any:
        deadline = time.monotonic() + deadline_s
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {deadline_s:.0f} s\n{explain()}")
            time.sleep(0.5)  # polling the API, not a guess at how long it takes

    def create_s3_secret(self, namespace: str) -> None:
        """The Secret the run file names (spec.secrets.s3Credentials), with moto's dummy credentials."""
        self.kubectl(
            "-n",
            namespace,
            "create",
            "secret",
            "generic",
            "s3-trainer",
            "--from-literal=AWS_ACCESS_KEY_ID=testing",
            "--from-literal=AWS_SECRET_ACCESS_KEY=testing",
        )

    def wait_finished(self, namespace: str, name: str, explain: Callable[[], str]) -> dict[str, Any]:
        """The run once Succeeded or Failed."""

        def finished() -> dict[str, Any]:
            run = self.run(namespace, name)
            return run if (run.get("status") or {}).get("phase") in ("Succeeded", "Failed") else {}

        return self.wait("Succeeded", finished, explain=explain)

    def pod_logs(self, namespace: str) -> dict[str, str]:
        """{pod: its log} of every pod in the namespace."""
        return {
            pod: self.kubectl("-n", namespace, "logs", pod, check=False).stdout
            for pod in self.kubectl("-n", namespace, "get", "pods", "-o", "name").stdout.split()
        }

    def diagnose(self, namespace: str) -> str:
        parts = [
            self.kubectl("-n", namespace, "get", f"trainingruns,{self.jobs},pods", "-o", "wide", check=False).stdout,
            self.kubectl("-n", namespace, "get", "events", "--sort-by=.lastTimestamp", check=False).stdout[-3000:],
            self.kubectl(
                "-n",
                OPERATOR_NAMESPACE,
                "logs",
                "-l",
                "app.kubernetes.io/name=trainingrun-operator",
                "--tail=40",
                check=False,
            ).stdout,
        ]
        for pod in self.kubectl("-n", namespace, "get", "pods", "-o", "name", check=False).stdout.split():
            parts.append(f"--- {pod}\n" + self.kubectl("-n", namespace, "logs", pod, "--tail=25", check=False).stdout)
        return "\n".join(parts)


def install_kubeflow(plane: kube_cluster.ControlPlane) -> None:
    """Kubeflow's standalone overlay, as its README installs it, and wait until its webhook answers."""
    plane.kubectl("apply", "--server-side", "-f", str(KUBEFLOW_MANIFEST))
    plane.kubectl("-n", "kubeflow", "rollout", "status", "deploy/training-operator", "--timeout=180s")
    probe = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "probe", "namespace": "default"},
        "spec": {
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": 1,
                    "template": {
                        "spec": {"containers": [{"name": "pytorch", "image": "localhost/k8s-test/pause:3.10"}]}
                    },
                }
            }
        },
    }
    wait_for_webhook(plane, "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs", probe, "Kubeflow's")


def wait_for_webhook(plane: kube_cluster.ControlPlane, collection: str, probe: dict[str, Any], whose: str) -> None:
    """Until a dry-run create of `probe` is admitted: the controller's webhook answers."""
    deadline = time.monotonic() + 120
    while plane.request("POST", f"{collection}?dryRun=All", probe)[0] != 201:
        assert time.monotonic() < deadline, f"{whose} webhook never answered"
        time.sleep(0.5)  # polling the webhook


def install_jobset(plane: kube_cluster.ControlPlane) -> None:
    """JobSet's upstream manifests (its controller making its own webhook certificates), its CPU request lowered for
    the 2-CPU node, and wait until its webhook answers."""
    manifest = JOBSET_MANIFEST.read_text().replace("cpu: 500m", "cpu: 100m")
    plane.kubectl("apply", "--server-side", "-f", "-", input=manifest)
    plane.kubectl("-n", "jobset-system", "rollout", "status", "deploy/jobset-controller-manager", "--timeout=180s")
    probe = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "probe", "namespace": "default"},
        "spec": {
            "replicatedJobs": [
                {
                    "name": "w",
                    "template": {
                        "spec": {
                            "template": {
                                "spec": {
                                    "restartPolicy": "Never",
                                    "containers": [{"name": "c", "image": "localhost/k8s-test/pause:3.10"}],
                                }
                            }
                        }
                    },
                }
            ]
        },
    }
    wait_for_webhook(plane, "/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets", probe, "JobSet's")


def helm(*args: str, kubeconfig: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(HELM), f"--kubeconfig={kubeconfig}", *args], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result


@contextlib.contextmanager
def started(workdir: Path, backend: str = "PyTorchJob") -> Iterator[Cluster]:
    """The cluster with Kubeflow (backend PyTorchJob), JobSet and no Kubeflow (backend JobSet) or both (backend both:
    runs name theirs, for side-by-side figures) running and the S3 server up (the chart not yet installed)."""
    plane = kube_cluster.ControlPlane(
        Path(os.environ[kube_cluster.ASSETS_ENV]), workdir / "plane", node=(kube_node.NODE_NAME, kube_node.NODE_IP)
    )
    node = kube_node.Node(plane, workdir / "node")
    try:
        plane.start()
        node.start()
        for line in (IMAGES / "images.txt").read_text().splitlines():
            name, archive = line.split()
            node.import_image(IMAGES / archive, name)
        if backend in ("PyTorchJob", "both"):
            install_kubeflow(plane)
        if backend in ("JobSet", "both"):
            install_jobset(plane)
        with moto_s3(kube_node.NODE_IP) as s3:
            yield Cluster(plane, node, s3, backend)
    finally:
        node.stop()
        plane.stop()


def pod_processes(pod: str) -> list[int]:
    """The node's processes of one pod's containers (they all carry its name in their environment, the downward API's
    TRAININGRUN_POD_NAME): the launcher, its forkserver and the workers."""
    marker = f"TRAININGRUN_POD_NAME={pod}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def training_processes(pod: str) -> list[int]:
    """The training processes of a pod: the children of the launcher's forkserver (which forks them, so their command
    line is the forkserver's: what tells them apart is their parent)."""
    processes = set(pod_processes(pod))

    def parent(pid: int) -> int:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rpartition(")")[2].split()[1])

    def forkserver(pid: int) -> bool:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"forkserver" in cmdline.read()

    servers = {pid for pid in processes if forkserver(pid) and not forkserver(parent(pid))}  # the launcher's child
    return sorted(pid for pid in processes if parent(pid) in servers)


def lose_without_warning(cluster: Cluster, namespace: str, pod: str) -> None:
    """As a node failure loses a pod: every process of it stopped at once (no SIGTERM, so no emergency checkpoint),
    the pod force-deleted (so its controller makes it again: a new pod, its /dev/shm empty, not a container restarted
    in the same pod), then every process SIGKILLed. Stopped first, the processes neither handle the SIGTERM the
    kubelet sends for the deletion nor exit before the pod is gone."""
    processes = pod_processes(pod)
    assert processes, f"no process of {pod} on the node"
    for pid in processes:
        os.kill(pid, signal.SIGSTOP)
    code, answer = cluster.plane.request(
        "DELETE",
        f"/api/v1/namespaces/{namespace}/pods/{pod}",
        {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0},
    )
    assert code == 200, answer
    for pid in processes:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def install_chart(cluster: Cluster) -> None:
    """Our chart, as the README installs it, the images pointed at the local ones."""
    helm(
        "install",
        "trainingrun",
        str(CHART),
        "--namespace",
        OPERATOR_NAMESPACE,
        "--create-namespace",
        "--set",
        "image.repository=localhost/trainingrun-operator",
        "--set",
        f"image.tag={VERSION}",
        "--set",
        f"trainer.image=localhost/trainingrun-trainer:{VERSION}",
        "--wait",
        "--timeout=180s",
        kubeconfig=cluster.plane.admin_kubeconfig,
    )


def pod_monitor_targets(pod_monitor: dict[str, Any], plane: kube_cluster.ControlPlane) -> list[dict[str, Any]]:
    """The targets the Prometheus Operator would scrape for `pod_monitor`, found through the API server: the
    pods its selector matches (in any namespace, as its namespaceSelector says), at their port of the
    PodMonitor's port name, as Prometheus file_sd groups. (Debian's Prometheus is built without Kubernetes
    service discovery, so the test resolves the selector itself with the same API query.)"""
    spec = pod_monitor["spec"]
    assert spec.get("namespaceSelector") == {"any": True}, spec.get("namespaceSelector")
    terms = [f"{k}={v}" for k, v in spec["selector"].get("matchLabels", {}).items()]
    for expression in spec["selector"].get("matchExpressions", []):
        assert expression["operator"] == "Exists", expression  # the only kind the chart's PodMonitor uses
        terms.append(expression["key"])
    port_name = spec["podMetricsEndpoints"][0]["port"]
    code, pods = plane.request("GET", "/api/v1/pods?" + urllib.parse.urlencode({"labelSelector": ",".join(terms)}))
    assert code == 200, pods
    groups = []
    for pod in pods["items"]:
        ip = (pod.get("status") or {}).get("podIP")
        ports = [
            p["containerPort"]
            for c in pod["spec"]["containers"]
            for p in c.get("ports", [])
            if p.get("name") == port_name
        ]
        finished = (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")  # dropped, as the operator does
        if ip and ports and not finished:
            groups.append(
                {
                    "targets": [f"{ip}:{ports[0]}"],
                    "labels": {"pod": pod["metadata"]["name"], "pod_namespace": pod["metadata"]["namespace"]},
                }
            )
    return groups


def scrape_config(pod_monitor: dict[str, Any], targets_file: Path, interval: str) -> dict[str, Any]:
    """The scrape job for `pod_monitor`'s targets (written to `targets_file` by the caller), with its
    honorLabels; `interval` replaces the PodMonitor's, for a test's pace."""
    endpoint = pod_monitor["spec"]["podMetricsEndpoints"][0]
    return {
        "job_name": f"podMonitor/{pod_monitor['metadata']['name']}",
        "scrape_interval": interval,
        "honor_labels": endpoint.get("honorLabels", False),
        "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "1s"}],
    }


def reference_digest(folder: Path) -> str:
    """The model digest of the journey's file run uninterrupted with `trainingrun local` (2 processes) in `folder`:
    what every run of the end-to-end tier must end with, however its pods were lost."""
    import sys

    from trainingrun_trainer.checkpoint import CheckpointStore

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
