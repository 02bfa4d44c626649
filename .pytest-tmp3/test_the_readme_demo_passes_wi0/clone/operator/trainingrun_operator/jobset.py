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

from typing import Any, Optional

from trainingrun_api import contract

from . import api, naming
from .builders import as_started, attempt_metadata, pod_template, rendezvous_service
from .settings import Settings

API_VERSION = "jobset.x-k8s.io/v1alpha2"
KIND = "JobSet"
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
                    "template": {"metadata": {"labels": dict(meta["labels"])}, "spec": job_spec},
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
) -> list[dict[str, Any]]:
    """Everything one attempt needs on this backend: the rendezvous Service of a multi-pod run (selecting worker 0
    by its completion index) and the JobSet, last (as `builders.children` for a PyTorchJob)."""
    run = as_started(run, checkpoint_uri)
    support = (
        [rendezvous_service(run, attempt, COMPLETION_INDEX_LABEL)] if naming.has_rendezvous_service(run.spec) else []
    )
    return [*support, jobset(run, attempt, settings, resume_from)]
