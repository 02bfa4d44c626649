"""The operator for real (kopf, in the test's event loop) against kmock's stateful Kubernetes API.

Tests play the Kubeflow Training Operator and the kubelet: they patch PyTorchJob and pod status
through the API, exactly as those controllers would, and watch what the operator does in reply.
kmock limits (see ../shared/TESTING.md): no uid/generation/timestamps, no schema validation, no
status-subresource semantics, label selectors ignored. Tests set uid and resourceVersion themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import inspect
import logging
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional

import kmock as kmock_lib
import kopf
import yaml

from trainingrun_operator import api
from trainingrun_operator.handlers import run_operator
from trainingrun_operator.settings import Settings
from trainingrun_operator.state import OperatorState

RUNS = "trainingrun.dev/v1alpha1/trainingruns"
JOBS = "kubeflow.org/v1/pytorchjobs"
JOBSETS = "jobset.x-k8s.io/v1alpha2/jobsets"
BATCH_JOBS = "batch/v1/jobs"
PODS = "v1/pods"
EVENTS = "v1/events"
NAMESPACE = "team-a"
VERBS = {"list", "watch", "get", "patch", "create", "delete", "update"}

TEST_SETTINGS = Settings(
    metrics_port=0,
    health_port=0,
    reconcile_interval_seconds=0.2,
    crd_check_seconds=0.5,
    child_rejected_backoff_seconds=0.5,
)


def declare_resources(kmock: Any, pytorchjobs: bool = True, jobsets: bool = False) -> None:
    """Every resource kopf and the operator touch (without v1/namespaces kopf starts no watchers); JobSets and their
    batch Jobs with `jobsets`."""
    info = kmock_lib.ResourceInfo
    kmock.resources[RUNS] = info(kind="TrainingRun", namespaced=True, verbs=VERBS, subresources={"status"})
    if pytorchjobs:
        kmock.resources[JOBS] = info(kind="PyTorchJob", namespaced=True, verbs=VERBS, subresources={"status"})
    if jobsets:
        kmock.resources[JOBSETS] = info(kind="JobSet", namespaced=True, verbs=VERBS, subresources={"status"})
        kmock.resources[BATCH_JOBS] = info(kind="Job", namespaced=True, verbs=VERBS, subresources={"status"})
    kmock.resources[PODS] = info(kind="Pod", namespaced=True, verbs=VERBS, subresources={"status"})
    kmock.resources["v1/namespaces"] = info(kind="Namespace", namespaced=False, verbs={"list", "watch", "get"})
    kmock.resources[EVENTS] = info(kind="Event", namespaced=True, verbs=VERBS)
    kmock.resources["v1/configmaps"] = info(kind="ConfigMap", namespaced=True, verbs=VERBS)
    kmock.resources["v1/services"] = info(kind="Service", namespaced=True, verbs=VERBS)
    kmock.resources["v1/serviceaccounts"] = info(kind="ServiceAccount", namespaced=True, verbs=VERBS)
    kmock.resources["rbac.authorization.k8s.io/v1/roles"] = info(kind="Role", namespaced=True, verbs=VERBS)
    kmock.resources["rbac.authorization.k8s.io/v1/rolebindings"] = info(
        kind="RoleBinding", namespaced=True, verbs=VERBS
    )


def write_kubeconfig(path: Path, server: str, token: str) -> Path:
    """A kubeconfig for an operator process of its own (one cluster, one token user)."""
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "test",
                "clusters": [{"name": "test", "cluster": {"server": server}}],
                "users": [{"name": "test", "user": {"token": token}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
            }
        )
    )
    return path


async def eventually(check: Callable[[], Any], timeout: float = 15.0, what: Any = "") -> Any:
    """Wait until check() returns something truthy (polling the API state), or fail saying what
    (`what` may be a callable, for a description of the state at the time of failure). `check` may be async."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if inspect.isawaitable(result):
                result = await result
        except (KeyError, TypeError, IndexError, StopIteration):
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout}s waiting for {said or check}")
        await asyncio.sleep(0.02)


class Cluster:
    """kmock plus helpers that act like kubectl, the Kubeflow operator and the kubelet."""

    def __init__(self, kmock: Any):
        self.kmock = kmock

    # ------------------------------------------------------------ reading
    def obj(self, resource: str, name: str, namespace: Optional[str] = NAMESPACE) -> Optional[dict[str, Any]]:
        key = (kmock_lib.resource(resource), namespace, name)
        if key not in self.kmock.objects or self.kmock.objects[key].deleted:
            return None
        return copy.deepcopy(self.kmock.objects[key].raw)

    def run(self, name: str = "demo") -> dict[str, Any]:
        return self.obj(RUNS, name) or {}

    def status(self, name: str = "demo") -> dict[str, Any]:
        return self.run(name).get("status") or {}

    def job(self, name: str) -> Optional[dict[str, Any]]:
        return self.obj(JOBS, name)

    def job_names(self, run: str = "demo") -> list[str]:
        return sorted(
            key[2]
            for key, o in self.kmock.objects.items()
            if key[0] == kmock_lib.resource(JOBS)
            and not o.deleted
            and (o.raw.get("metadata", {}).get("labels") or {}).get("trainingrun.dev/run") == run
        )

    def events(self, reason: Optional[str] = None) -> list[dict[str, Any]]:
        found = [
            o.raw for key, o in self.kmock.objects.items() if key[0] == kmock_lib.resource(EVENTS) and not o.deleted
        ]
        return [e for e in found if reason is None or e.get("reason") == reason]

    def env_of(self, job_name: str) -> dict[str, Any]:
        container = self.job(job_name)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
        return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}

    # ------------------------------------------------------------ writing, through the API
    async def create_run(self, body: dict[str, Any]) -> None:
        body = copy.deepcopy(body)
        body["metadata"].setdefault("namespace", NAMESPACE)
        body["metadata"].setdefault("resourceVersion", "1")
        async with self.kmock.post(
            f"/apis/{RUNS.rsplit('/', 1)[0]}/namespaces/{body['metadata']['namespace']}/trainingruns", json=body
        ) as response:
            assert response.status < 300, await response.text()

    async def patch(
        self, resource: str, name: str, patch: dict[str, Any], namespace: str = NAMESPACE, subresource: str = ""
    ) -> None:
        group_version, plural = resource.rsplit("/", 1)
        prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        url = f"{prefix}/namespaces/{namespace}/{plural}/{name}" + (f"/{subresource}" if subresource else "")
        async with self.kmock.patch(
            url, json=patch, headers={"Content-Type": "application/merge-patch+json"}
        ) as response:
            assert response.status < 300, await response.text()

    async def delete(self, resource: str, name: str, namespace: str = NAMESPACE) -> None:
        group_version, plural = resource.rsplit("/", 1)
        prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        async with self.kmock.delete(f"{prefix}/namespaces/{namespace}/{plural}/{name}") as response:
            assert response.status < 300, await response.text()

    async def warning(self, kind: str, name: str, reason: str, message: str) -> None:
        """A Warning Event, as Kubeflow (on a job) or the kubelet (on a pod) records one."""
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{name}.{reason.lower()}", "namespace": NAMESPACE, "resourceVersion": "1"},
            "involvedObject": {"kind": kind, "name": name, "namespace": NAMESPACE},
            "type": "Warning",
            "reason": reason,
            "message": message,
        }
        async with self.kmock.post(f"/api/v1/namespaces/{NAMESPACE}/events", json=event) as response:
            assert response.status < 300, await response.text()

    async def job_condition(self, job_name: str, *types: str, message: str = "") -> None:
        """As the Kubeflow operator reports a job's state."""
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        conditions = [
            {"type": t, "status": "True", "reason": f"PyTorchJob{t}", "message": message, "lastTransitionTime": now}
            for t in types
        ]
        await self.patch(JOBS, job_name, {"status": {"conditions": conditions}}, subresource="status")

    async def add_pod(self, job_name: str, index: int = 0, status: Optional[dict[str, Any]] = None) -> str:
        """As the Kubeflow operator creates a worker pod (labels from the job's template)."""
        job = self.job(job_name)
        labels = dict(job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["labels"])
        labels["training.kubeflow.org/job-name"] = job_name
        name = f"{job_name}-worker-{index}"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels, "resourceVersion": "1"},
            "spec": {},
            "status": status or {"phase": "Pending"},
        }
        async with self.kmock.post(f"/api/v1/namespaces/{NAMESPACE}/pods", json=pod) as response:
            assert response.status < 300, await response.text()
        return name

    async def pod_status(self, pod_name: str, status: dict[str, Any], **metadata: Any) -> None:
        """As the kubelet reports a pod's state."""
        patch: dict[str, Any] = {"status": status}
        if metadata:
            patch["metadata"] = metadata
        await self.patch(PODS, pod_name, patch)

    async def progress(
        self,
        name: str,
        step: int,
        updated_at: str,
        productive_seconds: float = 0.0,
        checkpoint: Optional[dict[str, Any]] = None,
    ) -> None:
        """As the operator writes what the trainer's rank 0 reported (reports.py; the endpoint itself is tested
        with real tokens in tests/real_api/test_reports_real.py)."""
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        status: dict[str, Any] = {
            "progress": {"step": step, "updatedAt": updated_at, "productiveSeconds": productive_seconds},
            "lastReportTime": now,
        }
        if checkpoint:
            status["lastGoodCheckpoint"] = checkpoint
        await self.patch(RUNS, name, {"status": status}, subresource="status")


def terminated(exit_code: int, reason: str = "Error", message: str = "") -> dict[str, Any]:
    """A pod status whose trainer container ended with `exit_code`."""
    return {
        "phase": "Failed",
        "containerStatuses": [
            {"name": "pytorch", "state": {"terminated": {"exitCode": exit_code, "reason": reason, "message": message}}}
        ],
    }


def running() -> dict[str, Any]:
    return {"phase": "Running", "containerStatuses": [{"name": "pytorch", "state": {"running": {}}}]}


def training_run(name: str = "demo", uid: str = "0000-demo", **spec: Any) -> dict[str, Any]:
    body = {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid},
        "spec": {"checkpoint": {"uri": f"s3://bucket/{name}"}, "recovery": {"backoffSeconds": 0}},
    }
    for key, value in spec.items():
        body["spec"][key] = value
    return body


@contextlib.asynccontextmanager
async def operator(kmock: Any, settings: Settings = TEST_SETTINGS, **state_fields: Any) -> AsyncIterator[OperatorState]:
    """Run the operator until the block ends; it has opened its watches when the block starts."""

    async def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"), insecure=True)

    state = OperatorState(settings, login=login, **state_fields)
    stop: asyncio.Future = asyncio.get_running_loop().create_future()
    ready = asyncio.Event()
    task = asyncio.create_task(run_operator(state, stop_flag=stop, ready_flag=ready))
    await asyncio.wait_for(ready.wait(), 20)
    await eventually(
        lambda: any("watch=true" in str(r.url) and "trainingruns" in str(r.url) for r in list(kmock)),
        what="kopf to watch TrainingRuns",
    )
    try:
        yield state
    finally:
        stop.set_result(None)
        await asyncio.wait_for(task, 30)


def settings(**changes: Any) -> Settings:
    return dataclasses.replace(TEST_SETTINGS, **changes)


logging.getLogger("kopf").setLevel(logging.INFO)
