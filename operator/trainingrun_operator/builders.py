"""Pure builders: a TrainingRun (and an attempt number) in, Kubernetes objects out.

Nothing here calls the API; the kopf handlers call these and send what they return. Every child is
named deterministically from the run, so a restarted operator finds what it made before instead of
making it twice, and is owned by the run, so deleting the run deletes them.

Over 500 lines because it renders every object the operator sends (ConfigMap, PyTorchJob, rendezvous
Service, Events) with the contract and quantities they share; split by object before it grows further.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import uuid
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Optional

from trainingrun_api import contract
from trainingrun_api.config import RunConfig, config_json

from . import api
from .settings import Settings

if TYPE_CHECKING:
    from .reconcile import Note

# torchrun's elastic agent, wrapped so the container's exit code keeps ExitCode semantics (launch.py).
DEFAULT_COMMAND = ["python", "-m", "trainingrun_trainer.launch", "--module", "trainingrun_trainer"]
# How long the agent leaves workers to write the emergency checkpoint after SIGTERM, short of the
# pod's grace period so the agent itself still exits before the kubelet's SIGKILL.
SHUTDOWN_MARGIN_SECONDS = 15
CONTAINER_NAME = "pytorch"  # the Kubeflow Training Operator finds the trainer container by this name
LABEL_RUN = "trainingrun.dev/run"
LABEL_ATTEMPT = "trainingrun.dev/attempt"
#: The Kubeflow Training Operator labels each pod with its replica index (0 hosts the rendezvous store).
KUBEFLOW_REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
ANNOTATION_RESUME_FROM = "trainingrun.dev/resume-from"
#: On each PyTorchJob: a digest of the spec its pods were built from, so a later spec change shows.
ANNOTATION_SPEC_HASH = "trainingrun.dev/spec-hash"
#: On each PyTorchJob the operator creates: what only it can write (`job_signature`), which a job someone else made
#: under the same name lacks.
ANNOTATION_SIGNATURE = "trainingrun.dev/signature"
#: On each PyTorchJob: the run's metadata.generation it was built from. The API server bumps it on every spec
#: change, so an equal generation answers "unchanged?" without hashing the spec at every reconcile.
ANNOTATION_GENERATION = "trainingrun.dev/generation"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
#: Lifetime of a pod's report token; the kubelet replaces it at 80% of that.
REPORT_TOKEN_SECONDS = 3600
SECRET_FILE_MODE = 0o440  # group-readable, so the non-root trainer reads it through fsGroup


# ---------------------------------------------------------------- names


def job_name(run_name: str, attempt: int) -> str:
    return f"{run_name}-a{attempt}"


def job_signature(key: bytes, run_uid: str, name: str) -> str:
    """HMAC of a run's job name with the operator's signing key (Settings.signing_key)."""
    return hmac.new(key, f"{run_uid}/{name}".encode(), hashlib.sha256).hexdigest()[:32]


def spec_hash(run: api.TrainingRun) -> str:
    """Digest of what an attempt's pods are built from; `suspend` changes no pod and is left out."""
    spec = run.spec.model_dump(mode="json", by_alias=True)
    spec.pop("suspend", None)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def config_map_name(run_name: str) -> str:
    return f"{run_name}-config"


def rendezvous_service_name(run_name: str) -> str:
    return f"{run_name}-rendezvous"


def worker_pod(run_name: str, attempt: int, index: int) -> str:
    return f"{job_name(run_name, attempt)}-worker-{index}"  # the name Kubeflow gives the pod of Worker replica `index`


def rendezvous_host_pod(run_name: str, attempt: int) -> str:
    return worker_pod(run_name, attempt, 0)


def has_rendezvous_service(spec: api.TrainingRunSpec) -> bool:
    """Pods of a multi-pod run reach the rendezvous store through the run's Service; one pod needs none."""
    return spec.replicas.effective_max > 1


# ---------------------------------------------------------------- shared parts


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


# ---------------------------------------------------------------- children


def config_map(run: api.TrainingRun, settings: Settings = Settings()) -> dict[str, Any]:
    """The trainer config every pod mounts (defaults filled in, so the pod sees what ran), and the CA
    certificate pods verify the operator's report endpoint with."""
    config = RunConfig(trainer=run.spec.trainer, checkpoint=run.spec.checkpoint)
    data = {contract.CONFIG_FILE_NAME: config_json(config)}
    if settings.report_ca:
        data[contract.REPORT_CA_KEY] = settings.report_ca
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(run, config_map_name(run.metadata.name), "config"),
        "data": data,
    }


def rendezvous_service(run: api.TrainingRun, attempt: int) -> dict[str, Any]:
    """A stable address for the rendezvous store of a multi-pod run: a ClusterIP Service selecting worker 0 of
    the current attempt (`elasticPolicy.rdzvHost`). Kubeflow's default host is worker 0's own DNS name, which
    disappears with the pod: a survivor that looks it up before the replacement exists gets "no such name", and
    cluster DNS caches that answer (5 s with CoreDNS), longer than the replacement takes to start. The Service's
    name resolves for the whole run; until the replacement has an address, connections are refused at once.
    Not-ready pods are published: the store listens before any readiness would be known."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(run, rendezvous_service_name(run.metadata.name), "rendezvous"),
        "spec": {
            "type": "ClusterIP",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_RUN: run.metadata.name, LABEL_ATTEMPT: str(attempt), KUBEFLOW_REPLICA_INDEX_LABEL: "0"},
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


#: torchrun settings every pod of a multi-pod run needs. torch reuses the first round's rendezvous store
#: as the workers' store and never republishes its address: a pod that replaces a deleted one would
#: wait for the next round until the survivors time out (exit 1, the run fails).
RENDEZVOUS_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


_QUANTITY_SUFFIXES = {
    "n": "1e-9",
    "u": "1e-6",
    "m": "1e-3",
    "k": "1e3",
    "M": "1e6",
    "G": "1e9",
    "T": "1e12",
    "P": "1e15",
    "E": "1e18",
    "Ki": "1024",
    "Mi": "1048576",
    "Gi": "1073741824",
    "Ti": "1099511627776",
    "Pi": "1125899906842624",
    "Ei": "1152921504606846976",
}


def quantity_value(quantity: str) -> Decimal:
    """A Kubernetes quantity as a number: '500m' -> 0.5, '2' -> 2, '1e3' -> 1000."""
    for suffix in sorted(_QUANTITY_SUFFIXES, key=len, reverse=True):
        if quantity.endswith(suffix) and not quantity[: -len(suffix)].endswith(("e", "E")):
            return Decimal(quantity[: -len(suffix)]) * Decimal(_QUANTITY_SUFFIXES[suffix])
    return Decimal(quantity)


def omp_threads(spec: api.TrainingRunSpec, nproc: Optional[int] = None) -> Optional[int]:
    """Intra-op threads per process: the pod's CPU request shared by its processes (at least 1).
    torch otherwise starts a thread per core of the node, whatever the pod may use: oversubscribed
    processes, and numerics that change with the node (a run and its resumed attempts, or the same
    file under `trainingrun local`, would not compute the same model)."""
    if not spec.resources.cpu:
        return None
    return max(1, int(quantity_value(spec.resources.cpu) // (nproc or spec.nproc_per_node)))


#: Where torch.compile keeps its caches in a pod: in /tmp, the pod's emptyDir, which outlives restarts in the pod.
COMPILE_CACHE_DIR = "/tmp/compile-cache"


def contract_env(
    run: api.TrainingRun, attempt: int, config_path: str, resume_from: Optional[str] = None
) -> dict[str, str]:
    """The plain-valued part of the operator-trainer contract (docs/architecture.md): the same for a pod and for
    `trainingrun local`, so the two cannot drift apart."""
    spec = run.spec
    env = {
        contract.NAME: run.metadata.name,
        contract.NAMESPACE: run.metadata.namespace,
        contract.UID: run.metadata.uid or "",
        contract.ATTEMPT: str(attempt),
        contract.CONFIG: config_path,
        "PYTHONUNBUFFERED": "1",
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(spec.termination_grace_period_seconds - SHUTDOWN_MARGIN_SECONDS),
        **RENDEZVOUS_ENV,
    }
    threads = omp_threads(spec)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if resume_from:
        env[contract.RESUME_FROM] = resume_from
    if spec.metrics.enabled:
        env[contract.METRICS_PORT] = str(spec.metrics.port)
    if spec.checkpoint.endpoint_url:
        env["AWS_ENDPOINT_URL"] = spec.checkpoint.endpoint_url
    return env


def report_interval_seconds(stall_timeout_seconds: int) -> float:
    """How often rank 0 reports, also when nothing changed: a quarter of a short stall timeout, so that with the
    endpoint's heartbeat writes (reports.heartbeat_write_seconds, a third) reports seen in status are never
    further apart than the timeout, which would read as ReportingUnavailable."""
    default = contract.DEFAULT_REPORT_INTERVAL_SECONDS
    return min(default, stall_timeout_seconds / 4) if stall_timeout_seconds else default


def trainer_env(
    run: api.TrainingRun, attempt: int, settings: Settings, resume_from: Optional[str]
) -> list[dict[str, Any]]:
    """The contract as container env; secrets appear only as secretKeyRef. A variable the user sets in
    env or secrets.env that the operator also sets as a default (HOME, PYTHONUNBUFFERED,
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT, TORCH_DISABLE_SHARE_RDZV_TCP_STORE, OMP_NUM_THREADS, TORCHINDUCTOR_CACHE_DIR,
    TRITON_CACHE_DIR) is the user's: the default is left out, never listed twice (the
    PyTorchJob CRD refuses a name given twice). Names the contract needs are refused by validation."""
    spec = run.spec
    users = {e.name for e in spec.env} | {e.name for e in spec.secrets.env}
    env: list[dict[str, Any]] = [
        {"name": name, "value": value}
        for name, value in contract_env(run, attempt, settings.config_path, resume_from).items()
    ]
    env += [
        {"name": contract.POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": contract.POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        *(
            [{"name": contract.RENDEZVOUS_HOST_POD, "value": rendezvous_host_pod(run.metadata.name, attempt)}]
            if has_rendezvous_service(spec)
            else []
        ),
        # The root filesystem is read-only; libraries that cache under ~ write to /tmp instead.
        {"name": "HOME", "value": "/tmp"},
        # torch.compile's caches in the pod's /tmp (an emptyDir): a worker restarted in place or a container
        # restarted in the pod finds what the last one compiled. Never in the bucket: loading a cache runs the code
        # in it, and what a bucket holds is not ours to run.
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{COMPILE_CACHE_DIR}/inductor"},
        {"name": "TRITON_CACHE_DIR", "value": f"{COMPILE_CACHE_DIR}/triton"},
    ]
    if settings.report_url:
        env += [
            {"name": contract.REPORT_URL, "value": settings.report_url},
            {"name": contract.REPORT_TOKEN_FILE, "value": contract.REPORT_TOKEN_PATH},
        ]
        interval = report_interval_seconds(spec.recovery.stall_timeout_seconds)
        if interval != contract.DEFAULT_REPORT_INTERVAL_SECONDS:
            env.append({"name": contract.REPORT_INTERVAL_SECONDS, "value": f"{interval:g}"})
        if settings.report_ca:
            env.append({"name": contract.REPORT_CA_FILE, "value": f"{settings.config_dir}/{contract.REPORT_CA_KEY}"})
    env = [e for e in env if e["name"] not in users]
    if spec.secrets.gcs_key_file:
        env.append({"name": "GOOGLE_APPLICATION_CREDENTIALS", "value": f"{settings.gcs_key_dir}/key.json"})
    s3 = spec.secrets.s3_credentials
    if s3:
        for name, key in (
            ("AWS_ACCESS_KEY_ID", s3.access_key_id_key),
            ("AWS_SECRET_ACCESS_KEY", s3.secret_access_key_key),
            ("AWS_SESSION_TOKEN", s3.session_token_key),
        ):
            if key:
                env.append(secret_env(name, s3.secret_name, key))
    env += [secret_env(e.name, e.secret_name, e.key) for e in spec.secrets.env]
    env += [{"name": e.name, "value": e.value} for e in spec.env]
    return env


def secret_env(name: str, secret_name: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": key}}}


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


def volumes_and_mounts(run: api.TrainingRun, settings: Settings) -> tuple[list[dict], list[dict]]:
    spec = run.spec
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_map_name(run.metadata.name)}},
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


def pod_template(run: api.TrainingRun, attempt: int, settings: Settings, resume_from: Optional[str]) -> dict[str, Any]:
    spec = run.spec
    volumes, mounts = volumes_and_mounts(run, settings)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image or settings.default_trainer_image,
        "command": list(spec.command or DEFAULT_COMMAND),
        "env": trainer_env(run, attempt, settings, resume_from),
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
        "affinity": spec.affinity.to_wire() if spec.affinity else None,
        "priorityClassName": spec.priority_class_name,
        "serviceAccountName": spec.service_account_name,  # else the namespace's default account
        # A name listed twice is listed once: the PyTorchJob CRD refuses duplicates, the run means the same.
        "imagePullSecrets": [{"name": n} for n in dict.fromkeys(spec.image_pull_secrets)],
    }
    pod_spec.update({k: v for k, v in optional.items() if v})
    template_metadata: dict[str, Any] = {
        "labels": {**spec.pod_labels, **labels(run, "trainer"), LABEL_ATTEMPT: str(attempt)}
    }
    if spec.pod_annotations:
        template_metadata["annotations"] = dict(spec.pod_annotations)
    return {"metadata": template_metadata, "spec": pod_spec}


def pytorch_job(
    run: api.TrainingRun,
    attempt: int,
    settings: Settings = Settings(),
    resume_from: Optional[str] = None,
) -> dict[str, Any]:
    """The kubeflow.org/v1 PyTorchJob of one attempt: elastic workers only, rendezvous over c10d."""
    if attempt < 1:
        raise ValueError(f"attempt must be 1 or more, got {attempt}")
    spec = run.spec
    name = job_name(run.metadata.name, attempt)
    meta = metadata(run, name, "trainer", **{LABEL_ATTEMPT: str(attempt)})
    if spec.queue_name:
        meta["labels"][KUEUE_QUEUE_LABEL] = spec.queue_name
    meta["annotations"] = {ANNOTATION_SPEC_HASH: spec_hash(run)}
    if settings.signing_key:
        meta["annotations"][ANNOTATION_SIGNATURE] = job_signature(settings.signing_key, str(run.metadata.uid), name)
    if run.metadata.generation is not None:
        meta["annotations"][ANNOTATION_GENERATION] = str(run.metadata.generation)
    if resume_from:
        meta["annotations"][ANNOTATION_RESUME_FROM] = resume_from
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
        # Unique per run and attempt: a new attempt never joins a stale rendezvous.
        "rdzvId": f"{run.metadata.uid or run.metadata.name}-a{attempt}",
        "maxRestarts": spec.recovery.max_restarts_per_attempt,
    }
    if has_rendezvous_service(spec):
        elastic_policy["rdzvHost"] = rendezvous_service_name(run.metadata.name)
        elastic_policy["rdzvPort"] = contract.RENDEZVOUS_PORT
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": meta,
        "spec": {
            "nprocPerNode": str(spec.nproc_per_node),
            "elasticPolicy": elastic_policy,
            "runPolicy": run_policy,
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": spec.replicas.effective_max,
                    "restartPolicy": "ExitCode",
                    "template": pod_template(run, attempt, settings, resume_from),
                }
            },
        },
    }


def as_started(run: api.TrainingRun, checkpoint_uri: Optional[str]) -> api.TrainingRun:
    """The run as its attempts are built: with the checkpoint URI the operator decided they use (the one the run
    started with, `reconcile.decide`), whatever spec.checkpoint.uri says now."""
    if not checkpoint_uri or run.spec.checkpoint.uri == checkpoint_uri:
        return run
    changed = run.model_copy(deep=True)
    changed.spec.checkpoint.uri = checkpoint_uri
    return changed


def children(
    run: api.TrainingRun,
    attempt: int = 1,
    settings: Settings = Settings(),
    resume_from: Optional[str] = None,
    checkpoint_uri: Optional[str] = None,
) -> list[dict[str, Any]]:
    """Everything one attempt of a run needs: its ConfigMap, its rendezvous Service (multi-pod runs) and its
    PyTorchJob, last. `checkpoint_uri` (default: the spec's) reaches the pods through the config file alone."""
    run = as_started(run, checkpoint_uri)
    support = [config_map(run, settings)]
    if has_rendezvous_service(run.spec):
        support.append(rendezvous_service(run, attempt))
    return [*support, pytorch_job(run, attempt, settings, resume_from)]


def event_object(body: dict[str, Any], note: "Note", now: datetime) -> dict[str, Any]:
    """A core/v1 Event about the TrainingRun `body`, from this operator instance (the host name)."""
    meta = body.get("metadata") or {}
    stamp = contract.rfc3339(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta.get('name')}.{uuid.uuid4().hex[:12]}", "namespace": meta.get("namespace")},
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
        "reportingInstance": socket.gethostname(),
    }
