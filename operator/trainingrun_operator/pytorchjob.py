"""One attempt of a run as a Kubeflow PyTorchJob (kubeflow.org/v1), and how its state and failures read: the backend
for clusters with Kubeflow's training operator v1 (`jobset` is the other; `backends` lists them).

Kubeflow's controller makes the pods (`<job>-worker-<i>`), gives them torchrun's settings from the elasticPolicy,
replaces a pod that is lost or exits retryably (restartPolicy ExitCode, up to backoffLimit: its Restarting
condition) and fails the job on a permanent exit code (1-127).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from trainingrun_api import contract

from . import api, naming
from .builders import as_started, attempt_metadata, pod_template, rendezvous_service
from .settings import Settings

API_VERSION = "kubeflow.org/v1"
KIND = "PyTorchJob"
PLURAL = "pytorchjobs"
#: The label Kubeflow gives each pod of a job: the job's name.
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
INSTALL = (
    "install the Kubeflow Training Operator v1.9 "
    '(kubectl apply --server-side -k "github.com/kubeflow/training-operator.git/manifests/overlays/'
    'standalone?ref=v1.9.4")'
)


def pytorch_job(
    run: api.TrainingRun,
    attempt: int,
    settings: Settings = Settings(),
    resume_from: Optional[str] = None,
    avoid_nodes: Sequence[str] = (),
) -> dict[str, Any]:
    """The kubeflow.org/v1 PyTorchJob of one attempt: elastic workers only, rendezvous over c10d."""
    spec = run.spec
    meta = attempt_metadata(run, attempt, resume_from)
    run_policy: dict[str, Any] = {
        # Pods stay after the job ends so their logs can be read; deleting the job removes them.
        "cleanPodPolicy": "None",
        "backoffLimit": spec.recovery.max_restarts_per_attempt,
        "suspend": spec.suspend,
    }
    if spec.active_deadline_seconds:
        run_policy["activeDeadlineSeconds"] = spec.active_deadline_seconds
    elastic_policy: dict[str, Any] = {
        "minReplicas": spec.replicas.min,
        "maxReplicas": spec.replicas.effective_max,
        "rdzvBackend": "c10d",
        "rdzvId": naming.rendezvous_id(run, attempt),
        "maxRestarts": spec.recovery.max_restarts_per_attempt,
    }
    if naming.has_rendezvous_service(spec):
        elastic_policy["rdzvHost"] = naming.rendezvous_service_name(run.metadata.name)
        elastic_policy["rdzvPort"] = contract.RENDEZVOUS_PORT
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": meta,
        "spec": {
            "nprocPerNode": str(spec.nproc_per_node),
            "elasticPolicy": elastic_policy,
            "runPolicy": run_policy,
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": spec.replicas.effective_max,
                    "restartPolicy": "ExitCode",
                    "template": pod_template(run, attempt, settings, resume_from, avoid_nodes=avoid_nodes),
                }
            },
        },
    }


def children(
    run: api.TrainingRun,
    attempt: int = 1,
    settings: Settings = Settings(),
    resume_from: Optional[str] = None,
    checkpoint_uri: Optional[str] = None,
    avoid_nodes: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Everything one attempt of a run needs: its rendezvous Service (multi-pod runs) and its PyTorchJob, last (its
    pods carry the config: config_annotations). `checkpoint_uri` (default: the spec's) reaches the pods through the
    config file alone."""
    run = as_started(run, checkpoint_uri)
    support = [rendezvous_service(run, attempt)] if naming.has_rendezvous_service(run.spec) else []
    return [*support, pytorch_job(run, attempt, settings, resume_from, avoid_nodes)]


# ---------------------------------------------------------------- reading its state


def state(job: dict[str, Any], pods: list[dict[str, Any]]) -> Optional[str]:
    """Succeeded, Failed, Suspended, Running, Restarting or Created, from the Kubeflow job conditions."""
    true = {c.get("type") for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"}
    for found in ("Succeeded", "Failed", "Suspended", "Running", "Restarting", "Created"):
        if found in true:
            return found
    return None


def restarting(job: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The PyTorchJob's Restarting condition while it is true: Kubeflow sets it (and drops Running) each time it
    replaces a pod of the job, and drops it when the job runs again."""
    return next(
        (
            c
            for c in (job.get("status") or {}).get("conditions") or []
            if c.get("type") == "Restarting" and c.get("status") == "True"
        ),
        None,
    )


def pods_replaced(
    job: dict[str, Any], parts: list[dict[str, Any]], restarts: dict[str, Any]
) -> Optional[tuple[int, dict[str, Any], str]]:
    """Pods replaced within the attempt since `restarts` (status) last counted: (how many more, the status fields
    that record them, what Kubeflow said), or None. A Restarting condition not counted yet (its transition time is
    the key) is one more."""
    condition = restarting(job)
    since = condition.get("lastTransitionTime") if condition else None
    if not condition or not since or since == restarts.get("lastInPlaceTime"):
        return None
    return 1, {"lastInPlaceTime": since}, condition.get("message") or "pods restarted"


def suspend_patch() -> dict[str, Any]:
    return {"spec": {"runPolicy": {"suspend": True}}}


def slim(body: dict[str, Any]) -> dict[str, Any]:
    """What the operator keeps of a PyTorchJob's spec and status (indexes.slim_job)."""
    return {
        "spec": {"runPolicy": {"suspend": ((body.get("spec") or {}).get("runPolicy") or {}).get("suspend")}},
        "status": {"conditions": (body.get("status") or {}).get("conditions") or []},
    }
