"""What a run's children say, whatever their backend, read from the job and pod dicts the indexes hold: which pods
belong to an attempt, why an attempt failed (preemption, a permanent verdict or a retryable failure), and what keeps
its pods from running (unschedulable, not created, a missing Secret or volume). A job's own state is its backend's
(pytorchjob.py, jobset.py). Pure: no API calls, no clock."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Optional

from trainingrun_api import contract, exit_codes

from . import naming, pytorchjob

#: Pod-level reasons that mean the node or the scheduler took the pod away, not the training code.
DISRUPTION_POD_REASONS = {"Evicted", "Preempting", "Terminated", "NodeShutdown", "Shutdown", "NodeLost"}


@dataclass
class Failure:
    cause: str  #: permanent, preemption or failure
    detail: str  #: what happened, for the Event and the condition
    exit_code: Optional[int] = None
    from_pods: bool = True  #: False when no pod said why (they may be gone, or not seen yet)


def attempt_of(obj: dict[str, Any]) -> Optional[int]:
    value = ((obj.get("metadata") or {}).get("labels") or {}).get(naming.LABEL_ATTEMPT)
    return int(value) if value and value.isdigit() else None


def pods_of(pods: list[dict[str, Any]], job_name: str, attempt: int) -> list[dict[str, Any]]:
    def belongs(pod: dict[str, Any]) -> bool:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        return labels.get(pytorchjob.JOB_NAME_LABEL) == job_name or attempt_of(pod) == attempt

    return [p for p in pods if belongs(p)]


def _trainer_terminations(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The trainer container's termination records (current state and the last one)."""
    found = []
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") != naming.CONTAINER_NAME:
            continue
        for key in ("state", "lastState"):
            terminated = (status.get(key) or {}).get("terminated")
            if terminated:
                found.append(terminated)
    return found


def _disruption(pod: dict[str, Any]) -> Optional[str]:
    status = pod.get("status") or {}
    for condition in status.get("conditions") or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            return f"pod {pod['metadata']['name']} was disrupted ({condition.get('reason') or 'DisruptionTarget'})"
    if status.get("reason") in DISRUPTION_POD_REASONS:
        return f"pod {pod['metadata']['name']} was {status['reason'].lower()}: {status.get('message') or ''}".rstrip(
            ": "
        )
    return None


def classify_failure(job: dict[str, Any], pods: list[dict[str, Any]]) -> Failure:
    """Why an attempt's job failed: preemption, a permanent error, or a (retryable) failure.

    A disrupted pod (DisruptionTarget condition, eviction, node shutdown) or the launcher's exit 143
    (emergency checkpoint after SIGTERM) is a preemption; 137 is one too when the pod was being
    deleted (SIGKILL after the grace period), else an OOM kill or crash. Exit codes 1-127 are the
    trainer's permanent verdicts (bad config, divergence): retrying cannot help.
    """
    for pod in pods:
        disrupted = _disruption(pod)
        if disrupted:
            return Failure("preemption", disrupted)
    codes = []
    for pod in pods:
        deleting = bool((pod.get("metadata") or {}).get("deletionTimestamp"))
        for terminated in _trainer_terminations(pod):
            code = terminated.get("exitCode")
            if code is None or code == 0:
                continue
            name = pod["metadata"]["name"]
            message = (terminated.get("message") or "").strip()
            reason = terminated.get("reason") or ""
            codes.append((code, name, reason, message, deleting))
    for code, name, _reason, _message, deleting in codes:
        if exit_codes.classify(code, stopping=deleting) == exit_codes.PREEMPTION:
            return Failure("preemption", f"pod {name} stopped after SIGTERM (exit code {code})", code)
    for code, name, reason, message, _ in codes:
        if exit_codes.classify(code) == exit_codes.PERMANENT:
            said = f": {message}" if message else (f" ({reason})" if reason else "")
            return Failure("permanent", f"pod {name} exited with {code}{said}", code)
    if codes:
        code, name, reason, message, _ = codes[0]
        said = f" ({reason})" if reason else ""
        return Failure("failure", f"pod {name} exited with {code}{said}", code)
    job_message = next(
        (
            c.get("message")
            for c in (job.get("status") or {}).get("conditions") or []
            if c.get("type") == "Failed" and c.get("status") == "True"
        ),
        None,
    )
    return Failure(
        "failure",
        f"{job.get('kind') or pytorchjob.KIND} {job['metadata']['name']} failed: {job_message or 'no reason given'}",
        from_pods=False,
    )


def failed_since(job: dict[str, Any]) -> Optional[datetime]:
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Failed" and condition.get("status") == "True":
            return contract.parse_time(condition.get("lastTransitionTime"))
    return None


def _names(message: str, secret_name: str) -> bool:
    """Whether a kubelet message names this Secret: `secret "s3" not found`, `... in Secret ns/s3`."""
    return re.search(rf'(^|["/\s]){re.escape(secret_name)}($|["\s:,;])', message) is not None


def missing_secret(pods: list[dict[str, Any]], secret_names: list[str]) -> Optional[str]:
    """The kubelet's message for a container that cannot start because a Secret or key is missing, with the
    Secrets the run reads when the message names none of them: a kubelet whose Secret cache has not synced yet
    says only "failed to sync secret cache: timed out waiting for the condition"."""
    for pod in pods:
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (status.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") == "CreateContainerConfigError":
                message = waiting.get("message") or "a Secret or key is missing"
                if secret_names and not any(_names(message, name) for name in secret_names):
                    message += (
                        f" (the run reads Secret{'s' if len(secret_names) > 1 else ''} {', '.join(secret_names)})"
                    )
                return f"pod {pod['metadata']['name']}: {message}"
    return None


#: Why an attempt's pods do not run, by condition type: (reason, message). Reported while the run is Pending
#: or Running (a replacement pod within the attempt).
BLOCKED_CONDITIONS = ("PodsNotCreated", "Unschedulable", "VolumeMountFailed", "ImagePullFailed")
#: The kubelet's reasons for a container waiting because its image cannot be had.
IMAGE_PULL_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
#: What Kubeflow's pod control records on a PyTorchJob, and the Job controller on a JobSet's Job, when a pod cannot be
#: created.
FAILED_CREATE_REASONS = ("FailedCreate", "FailedCreatePod")


def blocked_pods(
    job: dict[str, Any], pods: list[dict[str, Any]], warnings: list[dict[str, Any]]
) -> dict[str, tuple[str, str]]:
    """What keeps an attempt's pods from running, from the scheduler's pod conditions and the Warning Events
    of Kubeflow (on the PyTorchJob), the Job controller (on a JobSet's Job, `<jobset>-worker-0`) and the kubelet (on
    the pods). A missing Secret volume is `missing_secret_volume`'s."""
    job_name, kind = job["metadata"]["name"], job.get("kind") or pytorchjob.KIND
    found: dict[str, tuple[str, str]] = {}
    for pod in pods:
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (status.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in IMAGE_PULL_REASONS:
                said = f"{waiting['reason']}: {waiting.get('message') or 'the image cannot be pulled'}"
                found.setdefault(
                    "ImagePullFailed",
                    (
                        waiting["reason"],
                        f"pod {pod['metadata']['name']}: {said} (check spec.image or the chart's trainer.image, and "
                        "spec.imagePullSecrets for a private registry)",
                    ),
                )
        for condition in (pod.get("status") or {}).get("conditions") or []:
            if (
                condition.get("type") == "PodScheduled"
                and condition.get("status") == "False"
                and condition.get("reason") == "Unschedulable"
            ):
                found.setdefault(
                    "Unschedulable",
                    ("Unschedulable", f"pod {pod['metadata']['name']}: {condition.get('message') or 'no node fits'}"),
                )
    for event in warnings:
        about, reason, message = (
            (event.get("involvedObject") or {}).get("name"),
            event.get("reason"),
            event.get("message"),
        )
        # on the job itself, or on what it made and named after it (a JobSet's Job `<jobset>-worker-0`)
        if reason in FAILED_CREATE_REASONS and isinstance(about, str) and f"{about}-".startswith(f"{job_name}-"):
            where = f"{kind} {job_name}" if about == job_name else f"Job {about} of {kind} {job_name}"
            found.setdefault("PodsNotCreated", ("FailedCreate", f"{where}: {message}"))
        elif reason == "FailedMount" and not _about_secret(message):
            found.setdefault("VolumeMountFailed", ("FailedMount", f"pod {about}: {message}"))
    return found


def _about_secret(message: Any) -> bool:
    return isinstance(message, str) and 'secret "' in message and "not found" in message


def missing_secret_volume(warnings: list[dict[str, Any]]) -> Optional[str]:
    """The kubelet's FailedMount message for a Secret volume (the GCS key file) that does not exist."""
    for event in warnings:
        if event.get("reason") == "FailedMount" and _about_secret(event.get("message")):
            return f"pod {(event.get('involvedObject') or {}).get('name')}: {event['message']}"
    return None
