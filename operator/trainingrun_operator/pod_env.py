"""The trainer container's environment: the operator-trainer contract's variables (the same for a pod and for
`trainingrun local`), the report endpoint's, secrets by reference, and the thread count from the pod's CPUs. Pure.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, Optional

from trainingrun_api import contract

from . import api
from .naming import has_rendezvous_service, rendezvous_host_pod
from .settings import Settings

# How long the agent leaves workers to write the emergency checkpoint after SIGTERM, short of the
# pod's grace period so the agent itself still exits before the kubelet's SIGKILL.
SHUTDOWN_MARGIN_SECONDS = 15


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
        contract.HANG_TIMEOUT_SECONDS: str(spec.recovery.hang_timeout_seconds),
        contract.SLOW_RANK_FACTOR: f"{spec.recovery.slow_rank_factor:g}",
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
    run: api.TrainingRun, attempt: int, settings: Settings, resume_from: Optional[str], host_pod: Optional[str] = None
) -> list[dict[str, Any]]:
    """The contract as container env; secrets appear only as secretKeyRef. A variable the user sets in
    env or secrets.env that the operator also sets as a default (HOME, PYTHONUNBUFFERED,
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT, TORCH_DISABLE_SHARE_RDZV_TCP_STORE, OMP_NUM_THREADS, TORCHINDUCTOR_CACHE_DIR,
    TRITON_CACHE_DIR) is the user's: the default is left out, never listed twice (the
    PyTorchJob CRD refuses a name given twice). Names the contract needs are refused by validation. `host_pod`: the
    name or hostname of the pod that hosts the rendezvous store (default: Kubeflow's name of worker 0)."""
    spec = run.spec
    users = {e.name for e in spec.env} | {e.name for e in spec.secrets.env}
    env: list[dict[str, Any]] = [
        {"name": name, "value": value}
        for name, value in contract_env(run, attempt, settings.config_path, resume_from).items()
    ]
    env += [
        {"name": contract.POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": contract.POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": contract.NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        *(
            [
                {
                    "name": contract.RENDEZVOUS_HOST_POD,
                    "value": host_pod or rendezvous_host_pod(run.metadata.name, attempt),
                }
            ]
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
