"""Pure builders: a TrainingRun (and an attempt number) in, Kubernetes objects out.

Nothing here calls the API; the kopf handlers call these and send what they return. Every child is
named deterministically from the run (`naming`), so a restarted operator finds what it made before instead of
making it twice, and is owned by the run, so deleting the run deletes them. The trainer container's environment is
`pod_env`'s.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Optional, Sequence

from trainingrun_api import contract
from trainingrun_api.config import RunConfig, config_json

from . import api, kube_shapes, naming, pod_env
from .settings import Settings

# torchrun's elastic agent, wrapped so the container's exit code keeps ExitCode semantics (launch.py).
DEFAULT_COMMAND = ["python", "-m", "trainingrun_trainer.launch", "--module", "trainingrun_trainer"]
#: Lifetime of a pod's report token; the kubelet replaces it at 80% of that.
REPORT_TOKEN_SECONDS = 3600
SECRET_FILE_MODE = 0o440  # group-readable, so the non-root trainer reads it through fsGroup


# ---------------------------------------------------------------- children


def config_annotations(run: api.TrainingRun, settings: Settings = Settings()) -> dict[str, str]:
    """The trainer config every pod reads (defaults filled in, so the pod sees what ran) and the CA certificate pods
    verify the operator's report endpoint with, as pod annotations a downward API volume turns into files."""
    config = RunConfig(trainer=run.spec.trainer, checkpoint=run.spec.checkpoint)
    annotations = {naming.ANNOTATION_CONFIG: config_json(config)}
    if settings.report_ca:
        annotations[naming.ANNOTATION_REPORT_CA] = settings.report_ca
    return annotations


def rendezvous_service(
    run: api.TrainingRun, attempt: int, worker_index_label: str = naming.KUBEFLOW_REPLICA_INDEX_LABEL
) -> dict[str, Any]:
    """A stable address for the rendezvous store of a multi-pod run: a ClusterIP Service selecting worker 0 of
    the current attempt (`elasticPolicy.rdzvHost`). Kubeflow's default host is worker 0's own DNS name, which
    disappears with the pod: a survivor that looks it up before the replacement exists gets "no such name", and
    cluster DNS caches that answer (5 s with CoreDNS), longer than the replacement takes to start. The Service's
    name resolves for the whole run; until the replacement has an address, connections are refused at once.
    Not-ready pods are published: the store listens before any readiness would be known. `worker_index_label`: the
    pod label holding the worker's index (Kubeflow's replica index; a JobSet's Indexed Job's completion index)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": naming.metadata(run, naming.rendezvous_service_name(run.metadata.name), "rendezvous"),
        "spec": {
            "type": "ClusterIP",
            "publishNotReadyAddresses": True,
            "selector": {
                naming.LABEL_RUN: run.metadata.name,
                naming.LABEL_ATTEMPT: str(attempt),
                worker_index_label: "0",
            },
            "ports": [
                {
                    "name": "rendezvous",
                    "port": contract.RENDEZVOUS_PORT,
                    "targetPort": contract.RENDEZVOUS_PORT,
                    "protocol": "TCP",
                }
            ],
        },
    }


def resources(spec: api.TrainingRunSpec) -> dict[str, Any]:
    """Requests for CPU and memory, memory also as the limit (no CPU limit: throttling slows steps)."""
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if spec.resources.cpu:
        requests["cpu"] = spec.resources.cpu
    if spec.resources.memory:
        requests["memory"] = limits["memory"] = spec.resources.memory
    if spec.resources.gpu:
        requests[spec.resources.gpu_resource_name] = limits[spec.resources.gpu_resource_name] = str(spec.resources.gpu)
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def config_files(settings: Settings) -> list[dict[str, Any]]:
    """The files of the config volume (settings.config_dir), each an annotation of the pod (config_annotations)."""
    files = {contract.CONFIG_FILE_NAME: naming.ANNOTATION_CONFIG}
    if settings.report_ca:
        files[contract.REPORT_CA_KEY] = naming.ANNOTATION_REPORT_CA
    return [
        {"path": path, "fieldRef": {"fieldPath": f"metadata.annotations['{annotation}']"}}
        for path, annotation in files.items()
    ]


def volumes_and_mounts(run: api.TrainingRun, settings: Settings) -> tuple[list[dict], list[dict]]:
    spec = run.spec
    volumes: list[dict[str, Any]] = [
        {"name": "config", "downwardAPI": {"items": config_files(settings)}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shared_memory}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": settings.config_dir, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if settings.report_url:
        # The only API token a pod gets: bound to the pod, for the report endpoint's audience only (the API
        # server refuses it), rotated by the kubelet and read by the trainer at each report.
        volumes.append(
            {
                "name": "report-token",
                "projected": {
                    "sources": [
                        {
                            "serviceAccountToken": {
                                "audience": contract.REPORT_AUDIENCE,
                                "expirationSeconds": REPORT_TOKEN_SECONDS,
                                "path": contract.REPORT_TOKEN_PATH.rsplit("/", 1)[1],
                            }
                        }
                    ]
                },
            }
        )
        mounts.append({"name": "report-token", "mountPath": contract.REPORT_TOKEN_DIR, "readOnly": True})
    key_file = spec.secrets.gcs_key_file
    if key_file:
        volumes.append(
            {
                "name": "gcs-key",
                "secret": {
                    "secretName": key_file.secret_name,
                    "items": [{"key": key_file.key, "path": "key.json"}],
                    "defaultMode": SECRET_FILE_MODE,
                },
            }
        )
        mounts.append({"name": "gcs-key", "mountPath": settings.gcs_key_dir, "readOnly": True})
    return volumes, mounts


def tolerations(spec: api.TrainingRunSpec) -> list[dict[str, Any]]:
    result = [t.to_wire() for t in spec.tolerations]
    if spec.resources.gpu and not any(t.get("key") == spec.resources.gpu_resource_name for t in result):
        # GPU node pools are commonly tainted with the device resource name.
        result.append({"key": spec.resources.gpu_resource_name, "operator": "Exists", "effect": "NoSchedule"})
    return result


def pod_template(
    run: api.TrainingRun,
    attempt: int,
    settings: Settings,
    resume_from: Optional[str],
    host_pod: Optional[str] = None,
    torchrun_env: Optional[dict[str, str]] = None,
    avoid_nodes: Sequence[str] = (),
) -> dict[str, Any]:
    """A trainer pod of the attempt, as every backend runs it. `host_pod`: the pod hosting the rendezvous store (by
    name or hostname; default Kubeflow's worker 0); `torchrun_env`: torchrun's settings as PET_* variables, where the
    backend does not set them itself (Kubeflow does); `avoid_nodes`: nodes the pods must not run on (status.avoidedNodes:
    each named in two hangs in a row)."""
    spec = run.spec
    volumes, mounts = volumes_and_mounts(run, settings)
    env = pod_env.trainer_env(run, attempt, settings, resume_from, host_pod)
    # Validation refuses PET_* names in spec.env (torchrun's are the operator's), so none is given twice.
    env[:0] = [{"name": name, "value": value} for name, value in (torchrun_env or {}).items()]
    container: dict[str, Any] = {
        "name": naming.CONTAINER_NAME,
        "image": spec.image or settings.default_trainer_image,
        "command": list(spec.command or DEFAULT_COMMAND),
        "env": env,
        "volumeMounts": mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if spec.args is not None:
        container["args"] = list(spec.args)
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    if spec.metrics.enabled:
        container["ports"] = [{"name": "metrics", "containerPort": spec.metrics.port, "protocol": "TCP"}]
    container_resources = resources(spec)
    if container_resources:
        container["resources"] = container_resources

    pod_spec: dict[str, Any] = {
        # No API token: a trainer needs none (it reports to the operator with the projected token above).
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": spec.termination_grace_period_seconds,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.trainer_uid,
            "runAsGroup": settings.trainer_uid,
            "fsGroup": settings.trainer_uid,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
    }
    optional = {
        "nodeSelector": dict(spec.node_selector),
        "tolerations": tolerations(spec),
        "affinity": kube_shapes.avoiding(spec.affinity.to_wire() if spec.affinity else None, avoid_nodes),
        "priorityClassName": spec.priority_class_name,
        "serviceAccountName": spec.service_account_name,  # else the namespace's default account
        # A name listed twice is listed once: the PyTorchJob CRD refuses duplicates, the run means the same.
        "imagePullSecrets": [{"name": n} for n in dict.fromkeys(spec.image_pull_secrets)],
    }
    pod_spec.update({k: v for k, v in optional.items() if v})
    template_metadata: dict[str, Any] = {
        "labels": {**spec.pod_labels, **naming.labels(run, "trainer"), naming.LABEL_ATTEMPT: str(attempt)},
        "annotations": {**spec.pod_annotations, **config_annotations(run, settings)},  # the operator's win
    }
    return {"metadata": template_metadata, "spec": pod_spec}


def attempt_metadata(run: api.TrainingRun, attempt: int, resume_from: Optional[str]) -> dict[str, Any]:
    """The metadata of an attempt's job, whatever its kind: its name (`naming.job_name`), labels (Kueue's queue
    among them), owner, and what the operator reads back from it (the spec digest and generation it was made from,
    the checkpoint it resumes from)."""
    if attempt < 1:
        raise ValueError(f"attempt must be 1 or more, got {attempt}")
    meta = naming.metadata(
        run, naming.job_name(run.metadata.name, attempt), "trainer", **{naming.LABEL_ATTEMPT: str(attempt)}
    )
    if run.spec.queue_name:
        meta["labels"][naming.KUEUE_QUEUE_LABEL] = run.spec.queue_name
    meta["annotations"] = {naming.ANNOTATION_SPEC_DIGEST: naming.spec_digest(run)}
    if run.metadata.generation is not None:
        meta["annotations"][naming.ANNOTATION_GENERATION] = str(run.metadata.generation)
    if resume_from:
        meta["annotations"][naming.ANNOTATION_RESUME_FROM] = resume_from
    return meta


def as_started(run: api.TrainingRun, checkpoint_uri: Optional[str]) -> api.TrainingRun:
    """The run as its attempts are built: with the checkpoint URI the operator decided they use (the one the run
    started with, `reconcile.decide`), whatever spec.checkpoint.uri says now."""
    if not checkpoint_uri or run.spec.checkpoint.uri == checkpoint_uri:
        return run
    changed = run.model_copy(deep=True)
    changed.spec.checkpoint.uri = checkpoint_uri
    return changed


@dataclass
class Note:
    """A Kubernetes Event to post on the TrainingRun (the decisions of `reconcile` carry them)."""

    type: str  #: Normal or Warning
    reason: str
    message: str


#: Which operator instance posts the Events (its pod's host name), read once: a system call per Event was part of the
#: Event's 115-131 us of CPU in a burst of runs.
REPORTING_INSTANCE = socket.gethostname()
_last_event_ns = 0


def _event_suffix() -> str:
    """The wall clock's nanoseconds in hex, as client-go names Events, but never the same twice in this process (a
    coarse clock would give two Events of one run the same name, and the second would be refused)."""
    global _last_event_ns
    _last_event_ns = max(_last_event_ns + 1, time.time_ns())
    return f"{_last_event_ns:x}"


def event_object(body: dict[str, Any], note: Note, now: datetime) -> dict[str, Any]:
    """A core/v1 Event about the TrainingRun `body`, from this operator instance, named after the run and
    `_event_suffix` (no random bytes to read per Event; `now`, the operator's clock, may stand still in tests)."""
    meta = body.get("metadata") or {}
    stamp = contract.rfc3339(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta.get('name')}.{_event_suffix()}", "namespace": meta.get("namespace")},
        "involvedObject": {
            "apiVersion": api.API_VERSION,
            "kind": api.KIND,
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
        },
        "type": note.type,
        "reason": note.reason,
        "message": note.message[:1024],
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
        "source": {"component": "trainingrun-operator"},
        "reportingComponent": "trainingrun-operator",
        "reportingInstance": REPORTING_INSTANCE,
    }
