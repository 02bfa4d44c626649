"""One attempt of a run as a JobSet (jobset.x-k8s.io/v1alpha2), for clusters where Kubeflow's PyTorchJob is not
installed: pure builders, a run and an attempt number in, objects out (`builders` has the PyTorchJob's).

What Kubeflow's controller does for a PyTorchJob, the JobSet is told here:
- one replicated Job `worker` of `replicas.max` pods (an Indexed Job), with stable hostnames
  (`network.enableDNSHostnames`: `<job>-worker-0-<index>`), the pod template every backend shares;
- torchrun's settings as PET_* variables on the container (Kubeflow injects them): `replicas.min:max` nodes, the
  processes per node, c10d rendezvous at the run's rendezvous Service, which selects worker 0 of the attempt
  (its completion index 0) and whose store worker 0 hosts;
- a pod that fails with a retryable exit code (128-255) or is lost is replaced within the attempt by the Job
  controller, under the same hostname, and its elastic agent rejoins; up to `recovery.maxRestartsPerAttempt`
  such failures (the Job's backoffLimit; evictions and preemptions, which mark the pod DisruptionTarget, are not
  counted), as Kubeflow's backoffLimit counts them. An exit code 1-127 (the trainer's permanent verdicts, as
  `restartPolicy: ExitCode` reads them) fails the Job at once (podFailurePolicy);
- a failed Job fails the whole JobSet (`failurePolicy.maxRestarts: 0`): the next try is the operator's next
  attempt, with its budgets and backoff, never JobSet's own restarts as well.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from trainingrun_api import contract

from . import api, naming
from .builders import as_started, attempt_metadata, pod_template, rendezvous_service
from .settings import Settings

API_VERSION = "jobset.x-k8s.io/v1alpha2"
KIND = "JobSet"
PLURAL = "jobsets"
INSTALL = (
    "install JobSet v0.9 or later (kubectl apply --server-side -f "
    "https://github.com/kubernetes-sigs/jobset/releases/download/v0.9.1/manifests.yaml), or Kubeflow Trainer v2, "
    "which installs it"
)
#: The one replicated Job of an attempt.
REPLICATED_JOB = "worker"
#: The label the Job controller gives each pod of an Indexed Job: its index (worker 0 hosts the rendezvous).
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
#: The trainer's permanent verdicts (exit_codes.is_permanent): the Job fails at once, as Kubeflow's ExitCode policy.
PERMANENT_EXIT_CODES = list(range(1, 128))


def worker_hostname(run_name: str, attempt: int, index: int) -> str:
    """Worker `index`'s hostname (and DNS name within the JobSet's subdomain): `<jobset>-<replicated job>-<job
    index>-<pod index>`, the same for the pod that replaces it."""
    return f"{naming.job_name(run_name, attempt)}-{REPLICATED_JOB}-0-{index}"


def torchrun_env(run: api.TrainingRun, attempt: int) -> dict[str, str]:
    """torchrun's settings for a pod of the attempt, as the PET_* variables it reads (Kubeflow sets the same on a
    PyTorchJob's pods from its elasticPolicy)."""
    spec = run.spec
    env = {
        "PET_NPROC_PER_NODE": str(spec.nproc_per_node),
        "PET_MAX_RESTARTS": str(spec.recovery.max_restarts_per_attempt),
    }
    if not naming.has_rendezvous_service(spec):
        return {**env, "PET_STANDALONE": "1", "PET_NNODES": "1"}
    return {
        **env,
        "PET_NNODES": f"{spec.replicas.min}:{spec.replicas.effective_max}",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": f"{naming.rendezvous_service_name(run.metadata.name)}:{contract.RENDEZVOUS_PORT}",
        "PET_RDZV_ID": naming.rendezvous_id(run, attempt),
    }


def jobset(
    run: api.TrainingRun,
    attempt: int,
    settings: Settings = Settings(),
    resume_from: Optional[str] = None,
    avoid_nodes: Sequence[str] = (),
) -> dict[str, Any]:
    """The JobSet of one attempt, named, labelled and annotated as the PyTorchJob would be (`naming.job_name`)."""
    spec = run.spec
    meta = attempt_metadata(run, attempt, resume_from)
    pods = spec.replicas.effective_max
    template = pod_template(
        run,
        attempt,
        settings,
        resume_from,
        host_pod=worker_hostname(run.metadata.name, attempt, 0),
        torchrun_env=torchrun_env(run, attempt),
        avoid_nodes=avoid_nodes,
    )
    template["spec"]["restartPolicy"] = "Never"  # the Job replaces a failed pod; podFailurePolicy needs Never
    job_spec: dict[str, Any] = {
        "parallelism": pods,
        "completions": pods,
        "completionMode": "Indexed",
        "backoffLimit": spec.recovery.max_restarts_per_attempt,
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {
                        "containerName": naming.CONTAINER_NAME,
                        "operator": "In",
                        "values": PERMANENT_EXIT_CODES,
                    },
                },
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]
        },
        "template": template,
    }
    if spec.active_deadline_seconds:
        job_spec["activeDeadlineSeconds"] = spec.active_deadline_seconds
    job_labels = {k: v for k, v in meta["labels"].items() if k != naming.KUEUE_QUEUE_LABEL}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": meta,
        "spec": {
            "suspend": spec.suspend,
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": 0},
            "successPolicy": {"operator": "All"},
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": 1,
                    # Pods stay after the Job ends so their logs can be read; deleting the JobSet removes them.
                    # The run's labels but Kueue's: Kueue admits the JobSet as one workload, never its Job alone.
                    "template": {"metadata": {"labels": job_labels}, "spec": job_spec},
                }
            ],
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
    """Everything one attempt needs on this backend: the rendezvous Service of a multi-pod run (selecting worker 0
    by its completion index) and the JobSet, last (as `builders.children` for a PyTorchJob)."""
    run = as_started(run, checkpoint_uri)
    support = (
        [rendezvous_service(run, attempt, COMPLETION_INDEX_LABEL)] if naming.has_rendezvous_service(run.spec) else []
    )
    return [*support, jobset(run, attempt, settings, resume_from, avoid_nodes)]


# ---------------------------------------------------------------- reading its state


def state(job: dict[str, Any], pods: list[dict[str, Any]]) -> Optional[str]:
    """Succeeded, Failed, Suspended, Running or Created, as Kubeflow's conditions say them for a PyTorchJob: from the
    JobSet's conditions (Completed, Failed, Suspended), else Running once a pod of it runs (`pods`: the attempt's) or
    its Job is ready. JobSet has no Running condition, and none while a pod is replaced (Kubeflow's Restarting)."""
    status = job.get("status") or {}
    true = {c.get("type") for c in status.get("conditions") or [] if c.get("status") == "True"}
    for condition, said in (("Completed", "Succeeded"), ("Failed", "Failed"), ("Suspended", "Suspended")):
        if condition in true:
            return said
    running = any(
        (p.get("status") or {}).get("phase") == "Running" and not (p.get("metadata") or {}).get("deletionTimestamp")
        for p in pods
    )
    ready = any((r.get("ready") or 0) > 0 for r in status.get("replicatedJobsStatus") or [] if isinstance(r, dict))
    return "Running" if running or ready else "Created"


def pods_replaced(
    job: dict[str, Any], parts: list[dict[str, Any]], restarts: dict[str, Any]
) -> Optional[tuple[int, dict[str, Any], str]]:
    """Pods the attempt's Job replaced since `restarts` (status) last counted: (how many more, the status fields that
    record them, what happened), or None. The Job counts its failed pods (status.failed; those it ignores, evicted
    or preempted, are not among them), and status keeps how many of the current attempt's were counted."""
    failed = sum(int((p.get("status") or {}).get("failed") or 0) for p in parts)
    counted = int(restarts.get("attemptPodsFailed") or 0)
    if failed <= counted or any(_ending(p) for p in parts):
        return None  # nothing new, or the Job is failing: its last pods are not replaced, the attempt ends
    names = ", ".join(sorted(str((p.get("metadata") or {}).get("name")) for p in parts))
    more = failed - counted
    return more, {"attemptPodsFailed": failed}, f"{more} pod(s) of Job {names} failed or were lost and were replaced."


#: A Job's conditions once it is failing: it stops its pods (counted as failed too) and replaces none.
JOB_ENDING_CONDITIONS = ("FailureTarget", "Failed")


def _ending(part: dict[str, Any]) -> bool:
    conditions = (part.get("status") or {}).get("conditions") or []
    return any(c.get("type") in JOB_ENDING_CONDITIONS and c.get("status") == "True" for c in conditions)


def suspend_patch() -> dict[str, Any]:
    return {"spec": {"suspend": True}}


def slim(body: dict[str, Any]) -> dict[str, Any]:
    """What the operator keeps of a JobSet's spec and status (indexes.slim_job)."""
    status = body.get("status") or {}
    return {
        "spec": {"suspend": (body.get("spec") or {}).get("suspend")},
        "status": {
            "conditions": status.get("conditions") or [],
            "replicatedJobsStatus": [
                {k: r.get(k) for k in ("name", "ready", "active", "succeeded", "failed", "suspended")}
                for r in status.get("replicatedJobsStatus") or []
                if isinstance(r, dict)
            ][:8],
        },
    }


def slim_part(body: dict[str, Any]) -> dict[str, Any]:
    """What the operator keeps of the status of one of a JobSet's Jobs (batch/v1): its pods' counts."""
    status = body.get("status") or {}
    conditions = [
        {"type": c.get("type"), "status": c.get("status")}
        for c in status.get("conditions") or []
        if isinstance(c, dict) and c.get("type") in JOB_ENDING_CONDITIONS
    ]
    return {
        "status": {**{k: status.get(k) for k in ("active", "ready", "failed", "succeeded")}, "conditions": conditions}
    }
