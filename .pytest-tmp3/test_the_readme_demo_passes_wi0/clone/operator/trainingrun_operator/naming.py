"""Names, labels and annotations of everything the operator creates for a run: deterministic from the run, so a
restarted operator finds what it made before instead of making it twice; owned by the run, so deleting the run
deletes them. Pure (no API calls), like the builders that use them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

import orjson

from . import api

CONTAINER_NAME = "pytorch"  # the Kubeflow Training Operator finds the trainer container by this name
LABEL_RUN = "trainingrun.dev/run"
LABEL_ATTEMPT = "trainingrun.dev/attempt"
#: The Kubeflow Training Operator labels each pod with its replica index (0 hosts the rendezvous store).
KUBEFLOW_REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
ANNOTATION_RESUME_FROM = "trainingrun.dev/resume-from"
#: On each PyTorchJob: a digest of the spec its pods were built from (`spec_digest`), so a later spec change shows.
ANNOTATION_SPEC_DIGEST = "trainingrun.dev/spec-digest"
#: What operators before `spec_digest` put on their jobs instead (`legacy_spec_hash`): read, never written.
ANNOTATION_SPEC_HASH = "trainingrun.dev/spec-hash"
#: On each PyTorchJob the operator creates: what only it can write (`job_signature`), which a job someone else made
#: under the same name lacks.
ANNOTATION_SIGNATURE = "trainingrun.dev/signature"
#: On each PyTorchJob: the run's metadata.generation it was built from. The API server bumps it on every spec
#: change, so an equal generation answers "unchanged?" without hashing the spec at every reconcile.
ANNOTATION_GENERATION = "trainingrun.dev/generation"
#: On each attempt's pods (the PyTorchJob's pod template): the trainer config and the report endpoint's CA, which
#: a downward API volume mounts as files (builders.volumes_and_mounts). No ConfigMap: one write fewer per attempt,
#: and what a pod reads is fixed with its attempt.
ANNOTATION_CONFIG = "trainingrun.dev/config"
ANNOTATION_REPORT_CA = "trainingrun.dev/report-ca"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def job_name(run_name: str, attempt: int) -> str:
    return f"{run_name}-a{attempt}"


def job_signature(key: bytes, run_uid: str, name: str, job_uid: str) -> str:
    """HMAC of a run's job with the operator's signing key (Settings.signing_key), bound to the job's own uid, which
    the API server gives it at creation: copied onto another job (one planted under the same name after the run's
    was deleted), it is not that job's. Operators before this signed the run's uid and the name only (32 hex
    digits): those signatures are never taken, a job they made counts as the run's only by its status."""
    return "v2." + hmac.new(key, f"{run_uid}/{name}/{job_uid}".encode(), hashlib.sha256).hexdigest()[:32]


def _pod_spec(run: api.TrainingRun) -> dict[str, Any]:
    """What an attempt's pods are built from: the spec, less `suspend` (it changes no pod)."""
    spec = run.spec.model_dump(mode="json", by_alias=True)
    spec.pop("suspend", None)
    return spec


def spec_digest(run: api.TrainingRun) -> str:
    """Digest of what an attempt's pods are built from. orjson with sorted keys: a seventh of json.dumps' time, which
    was 3% of the operator's CPU in a burst of new runs."""
    return hashlib.sha256(orjson.dumps(_pod_spec(run), option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def legacy_spec_hash(run: api.TrainingRun) -> str:
    """The digest operators before `spec_digest` wrote (ANNOTATION_SPEC_HASH), for the jobs they left running."""
    return hashlib.sha256(json.dumps(_pod_spec(run), sort_keys=True).encode()).hexdigest()[:16]


def rendezvous_id(run: api.TrainingRun, attempt: int) -> str:
    """torchrun's rendezvous id of an attempt: unique per run and attempt, so a new attempt never joins a stale one."""
    return f"{run.metadata.uid or run.metadata.name}-a{attempt}"


def rendezvous_service_name(run_name: str) -> str:
    return f"{run_name}-rendezvous"


def worker_pod(run_name: str, attempt: int, index: int) -> str:
    return f"{job_name(run_name, attempt)}-worker-{index}"  # the name Kubeflow gives the pod of Worker replica `index`


def rendezvous_host_pod(run_name: str, attempt: int) -> str:
    return worker_pod(run_name, attempt, 0)


def labels(run: api.TrainingRun, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "trainingrun",
        "app.kubernetes.io/instance": run.metadata.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "trainingrun-operator",
        LABEL_RUN: run.metadata.name,
    }


def owner_reference(run: api.TrainingRun) -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "name": run.metadata.name,
        "uid": run.metadata.uid or "",
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(run: api.TrainingRun, name: str, component: str, **extra_labels: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": run.metadata.namespace,
        "labels": {**labels(run, component), **extra_labels},
        "ownerReferences": [owner_reference(run)],
    }


def has_rendezvous_service(spec: api.TrainingRunSpec) -> bool:
    """Pods of a multi-pod run reach the rendezvous store through the run's Service; one pod needs none."""
    return spec.replicas.effective_max > 1
