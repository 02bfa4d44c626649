"""Operator settings: every startup option in one place, read from the environment.

The Helm chart sets these variables on the operator Deployment; `trainingrun render` uses the
defaults unless the same variables are set in the shell.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainingrun_api import contract

from . import __version__, api
from .runtime import kube

if TYPE_CHECKING:
    from .report_connections import ReportLimits


#: TRAININGRUN_BACKEND's words: a backend's kind (api.BACKENDS), or auto.
BACKEND_CHOICES = ("auto", *api.BACKENDS)


@dataclass(frozen=True)
class Settings:
    """How the operator renders children and runs. Field by field (environment variable in brackets):"""

    #: Image used when a TrainingRun has no `spec.image` (TRAININGRUN_TRAINER_IMAGE).
    default_trainer_image: str = f"ghcr.io/trainingrun-dev/trainer:{__version__}"
    #: UID and GID trainer containers run as; the trainer image creates this user (TRAININGRUN_TRAINER_UID).
    trainer_uid: int = 1000
    #: Where the config volume (the trainer config and the report CA, from pod annotations) is mounted in trainers.
    config_dir: str = "/etc/trainingrun"
    #: Where a GCS key-file Secret is mounted.
    gcs_key_dir: str = "/var/run/secrets/trainingrun/gcs"
    #: What a run's attempts become when its spec.backend is empty (TRAININGRUN_BACKEND): PyTorchJob, JobSet, or
    #: auto: PyTorchJob when its CRD (Kubeflow's training operator) is served at start, else JobSet. It also
    #: limits what runs may ask for: PyTorchJob or JobSet allows only that backend (the chart grants the operator
    #: only its verbs); auto allows each one served at start (backends.py).
    backend: str = "auto"
    #: Cordon a node named in two hangs in a row of a run (TRAININGRUN_CORDON_AVOIDED_NODES=true; the chart value
    #: operator.cordonAvoidedNodes, which also grants `patch` on nodes). Off: the run's later pods only avoid it.
    cordon_avoided_nodes: bool = False
    #: Namespaces to watch, comma-separated; empty means the whole cluster (TRAININGRUN_NAMESPACES).
    namespaces: tuple[str, ...] = ()
    #: kopf peering object shared by the replicas, of which one acts; empty runs standalone
    #: (TRAININGRUN_PEERING). The chart creates the peering resources when it runs several replicas.
    peering: str = ""
    #: Seconds a replica's peering record stays valid without renewal (TRAININGRUN_PEERING_LIFETIME_SECONDS): how long
    #: the others wait after the acting replica dies without a word (SIGKILL, a lost node) before the next takes over.
    #: kopf renews it every second with 6 (max(1, lifetime - 5..10)); its default of 60 left runs unattended a minute.
    peering_lifetime_seconds: int = 6
    #: Port of /metrics and /readyz (TRAININGRUN_OPERATOR_METRICS_PORT); 0 turns them off.
    metrics_port: int = 9090
    #: Port of kopf's liveness endpoint /healthz (TRAININGRUN_OPERATOR_HEALTH_PORT); 0 turns it off.
    health_port: int = 8081
    #: A failed reconcile (an API error) is retried after this long, and the Warning Events of namespaces with
    #: attempts Pending for a while are read this often (TRAININGRUN_RECONCILE_INTERVAL_SECONDS). What depends on
    #: the clock (a backoff ending, a stall) is reconciled when it is due, not at this interval (rechecks.py).
    reconcile_interval_seconds: float = 10.0
    #: Every run is reconciled this often even without any event or due time, a safety net for a missed watch event,
    #: and whenever this replica starts acting (TRAININGRUN_RESYNC_SECONDS). With 20,000 runs, 600 s is 33 reconciles
    #: a second.
    resync_seconds: float = 600.0
    #: Failed attempts whose PyTorchJob (and pods, for their logs) are kept while the run goes on;
    #: older ones are deleted. When the run ends only the final attempt is kept (TRAININGRUN_KEEP_FAILED_ATTEMPTS).
    keep_failed_attempts: int = 1
    #: How often readiness re-checks that the PyTorchJob CRD is served (TRAININGRUN_CRD_CHECK_SECONDS).
    crd_check_seconds: float = 30.0
    #: After the API server refuses a run's objects (condition ChildRejected), the first wait before trying
    #: the same spec again; it doubles up to 300 s, and a spec change tries at once
    #: (TRAININGRUN_CHILD_REJECTED_BACKOFF_SECONDS).
    child_rejected_backoff_seconds: float = 10.0
    #: An attempt Pending for longer than this has its Warning Events read at each reconcile, so pods that are
    #: never created, scheduled or started show as a condition (TRAININGRUN_PENDING_EVENTS_AFTER_SECONDS).
    pending_events_after_seconds: float = 15.0
    #: Port of the HTTPS endpoint where trainer pods report progress (TRAININGRUN_REPORT_PORT); 0 turns it off.
    report_port: int = 8443
    #: The report endpoint's URL as trainer pods reach it, e.g. https://trainingrun-operator.<ns>.svc:8443/v1/reports
    #: (TRAININGRUN_REPORT_URL; the chart sets it). Empty: pods are given none and report nothing.
    report_url: str = ""
    #: Directory with the endpoint's certificate: tls.crt, tls.key and ca.crt, the CA pods verify it with
    #: (TRAININGRUN_REPORT_TLS_DIR; the chart mounts a Secret there).
    report_tls_dir: str = "/etc/trainingrun-operator/tls"
    #: PEM of ca.crt in report_tls_dir, read at start; published to pods in an annotation (builders.config_annotations).
    report_ca: str = ""
    #: The report Service, `namespace/name`, which has no selector: the replica that acts makes and owns its
    #: EndpointSlice `<name>-acting`, pointed at its own pod, so reports reach only the replica whose indexes are
    #: current (TRAININGRUN_REPORT_SERVICE; the chart sets it and makes the Service). Empty: nothing is published
    #: (an operator outside the cluster).
    report_service: str = ""
    #: This replica's pod IP and pod name, put in that EndpointSlice (TRAININGRUN_OPERATOR_POD_IP and
    #: TRAININGRUN_OPERATOR_POD_NAME: the chart sets them from the downward API).
    pod_ip: str = ""
    pod_name: str = ""
    #: How long a TokenReview's answer about a report token is reused (TRAININGRUN_REPORT_TOKEN_CACHE_SECONDS).
    report_token_cache_seconds: float = 60.0
    #: The report endpoint's limits on connections (`report_limits`; report_connections.ReportLimits says what each
    #: does, and its defaults are these): TRAININGRUN_REPORT_IDLE_TIMEOUT_SECONDS,
    #: TRAININGRUN_REPORT_BODY_MIN_BYTES_PER_SECOND, TRAININGRUN_REPORT_MAX_CONNECTIONS,
    #: TRAININGRUN_REPORT_MAX_CONNECTIONS_PER_ADDRESS.
    report_idle_timeout_seconds: float = 10.0
    report_body_min_bytes_per_second: float = 1024.0
    report_max_connections: int = 512
    report_max_connections_per_address: int = 32
    #: The operator's own API requests in flight at once; more wait, children of new attempts first, then
    #: status, then Events (TRAININGRUN_API_REQUESTS_IN_FLIGHT). Watches (informer.py) are not counted, lists are.
    api_requests_in_flight: int = kube.REQUESTS_IN_FLIGHT
    #: Runs reconciled at once (TRAININGRUN_RECONCILE_WORKERS); every trigger queues its run, and a run
    #: queued several times is reconciled once. Each reconcile holds its run's parsed spec while it waits
    #: for the API server, so this bounds the operator's memory in a burst.
    reconcile_workers: int = 64
    #: Signs each PyTorchJob the operator creates (naming.job_signature), so a job someone else planted under the
    #: name of a run's next attempt, with an owner reference to the run, is never taken as the run's: derived from the
    #: report endpoint's TLS key (tls.key in report_tls_dir, the same Secret on every replica), else random for this
    #: process. Empty: jobs are not signed (tests). Never logged.
    signing_key: bytes = field(default=b"", repr=False)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "Settings":
        env = os.environ if environ is None else environ
        defaults = cls()

        def number(name: str, default: float, kind: type = int) -> Any:
            raw = env.get(name)
            if raw in (None, ""):
                return default
            try:
                return kind(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a {'whole ' if kind is int else ''}number") from None

        for name, least in (
            ("TRAININGRUN_REPORT_MAX_CONNECTIONS", 1),
            ("TRAININGRUN_REPORT_MAX_CONNECTIONS_PER_ADDRESS", 1),
            ("TRAININGRUN_API_REQUESTS_IN_FLIGHT", 1),
            ("TRAININGRUN_RECONCILE_WORKERS", 1),
            ("TRAININGRUN_PEERING_LIFETIME_SECONDS", 2),  # renewed every second: 1 would expire between renewals
        ):
            if number(name, least) < least:
                raise ValueError(f"{name}={env[name]!r} must be at least {least}")
        for name in (
            "TRAININGRUN_RECONCILE_INTERVAL_SECONDS",
            "TRAININGRUN_RESYNC_SECONDS",
            "TRAININGRUN_REPORT_IDLE_TIMEOUT_SECONDS",
            "TRAININGRUN_REPORT_BODY_MIN_BYTES_PER_SECOND",
        ):
            if number(name, 1.0, float) <= 0:
                raise ValueError(f"{name}={env[name]!r} must be more than 0 seconds")
        backend = env.get("TRAININGRUN_BACKEND", "") or defaults.backend
        if backend not in BACKEND_CHOICES:
            raise ValueError(
                f"TRAININGRUN_BACKEND={backend!r} must be one of {', '.join(BACKEND_CHOICES)} (the chart value backend)"
            )
        report_url = env.get("TRAININGRUN_REPORT_URL", defaults.report_url)
        tls_dir = env.get("TRAININGRUN_REPORT_TLS_DIR", defaults.report_tls_dir)
        ca_path = Path(tls_dir) / "ca.crt"
        ca = ca_path.read_text() if report_url.startswith("https://") and ca_path.is_file() else ""
        if report_url.startswith("https://") and not ca:
            raise ValueError(
                f"TRAININGRUN_REPORT_URL is https, but {ca_path} does not exist: mount the report "
                "endpoint's certificate (tls.crt, tls.key, ca.crt) in TRAININGRUN_REPORT_TLS_DIR"
            )
        report_service = env.get("TRAININGRUN_REPORT_SERVICE", defaults.report_service)
        pod_ip = env.get("TRAININGRUN_OPERATOR_POD_IP", defaults.pod_ip)
        if report_service:
            namespace, _, name = report_service.partition("/")
            if not namespace or not name or "/" in name:
                raise ValueError(f"TRAININGRUN_REPORT_SERVICE={report_service!r} must be namespace/name")
            try:
                ipaddress.ip_address(pod_ip)
            except ValueError:
                raise ValueError(
                    f"TRAININGRUN_OPERATOR_POD_IP={pod_ip!r} is not an IP address: the replica that "
                    "acts points the report Service (TRAININGRUN_REPORT_SERVICE) at it (set it from the "
                    "downward API, fieldPath status.podIP)"
                ) from None
        return cls(
            default_trainer_image=env.get("TRAININGRUN_TRAINER_IMAGE", defaults.default_trainer_image),
            trainer_uid=number("TRAININGRUN_TRAINER_UID", defaults.trainer_uid),
            backend=backend,
            namespaces=tuple(n.strip() for n in env.get("TRAININGRUN_NAMESPACES", "").split(",") if n.strip()),
            peering=env.get("TRAININGRUN_PEERING", defaults.peering),
            peering_lifetime_seconds=number("TRAININGRUN_PEERING_LIFETIME_SECONDS", defaults.peering_lifetime_seconds),
            metrics_port=number("TRAININGRUN_OPERATOR_METRICS_PORT", defaults.metrics_port),
            health_port=number("TRAININGRUN_OPERATOR_HEALTH_PORT", defaults.health_port),
            reconcile_interval_seconds=number(
                "TRAININGRUN_RECONCILE_INTERVAL_SECONDS", defaults.reconcile_interval_seconds, float
            ),
            resync_seconds=number("TRAININGRUN_RESYNC_SECONDS", defaults.resync_seconds, float),
            keep_failed_attempts=number("TRAININGRUN_KEEP_FAILED_ATTEMPTS", defaults.keep_failed_attempts),
            cordon_avoided_nodes=_flag(env, "TRAININGRUN_CORDON_AVOIDED_NODES"),
            crd_check_seconds=number("TRAININGRUN_CRD_CHECK_SECONDS", defaults.crd_check_seconds, float),
            child_rejected_backoff_seconds=number(
                "TRAININGRUN_CHILD_REJECTED_BACKOFF_SECONDS", defaults.child_rejected_backoff_seconds, float
            ),
            pending_events_after_seconds=number(
                "TRAININGRUN_PENDING_EVENTS_AFTER_SECONDS", defaults.pending_events_after_seconds, float
            ),
            report_port=number("TRAININGRUN_REPORT_PORT", defaults.report_port),
            report_url=report_url,
            report_tls_dir=tls_dir,
            report_ca=ca,
            report_service=report_service,
            pod_ip=pod_ip,
            pod_name=env.get("TRAININGRUN_OPERATOR_POD_NAME", defaults.pod_name),
            report_token_cache_seconds=number(
                "TRAININGRUN_REPORT_TOKEN_CACHE_SECONDS", defaults.report_token_cache_seconds, float
            ),
            report_idle_timeout_seconds=number(
                "TRAININGRUN_REPORT_IDLE_TIMEOUT_SECONDS", defaults.report_idle_timeout_seconds, float
            ),
            report_body_min_bytes_per_second=number(
                "TRAININGRUN_REPORT_BODY_MIN_BYTES_PER_SECOND", defaults.report_body_min_bytes_per_second, float
            ),
            report_max_connections=number("TRAININGRUN_REPORT_MAX_CONNECTIONS", defaults.report_max_connections),
            report_max_connections_per_address=number(
                "TRAININGRUN_REPORT_MAX_CONNECTIONS_PER_ADDRESS", defaults.report_max_connections_per_address
            ),
            api_requests_in_flight=number("TRAININGRUN_API_REQUESTS_IN_FLIGHT", defaults.api_requests_in_flight),
            reconcile_workers=number("TRAININGRUN_RECONCILE_WORKERS", defaults.reconcile_workers),
            signing_key=signing_key(Path(tls_dir) / "tls.key"),
        )

    def report_limits(self) -> "ReportLimits":
        """The report endpoint's report_connections.ReportLimits from these settings."""
        from .report_connections import ReportLimits

        return ReportLimits(
            idle_timeout_seconds=self.report_idle_timeout_seconds,
            body_min_bytes_per_second=self.report_body_min_bytes_per_second,
            max_connections=self.report_max_connections,
            max_connections_per_address=self.report_max_connections_per_address,
        )

    @property
    def config_path(self) -> str:
        return f"{self.config_dir}/{contract.CONFIG_FILE_NAME}"


def signing_key(tls_key: Path) -> bytes:
    """The key jobs are signed with: derived (HMAC as a key derivation) from the report endpoint's private key when
    this process can read it, so every replica and every restart has the same one; else random, and only this
    process verifies what it signed (a restart still recognises the jobs its status already named, see
    indexes.run_owns_job)."""
    try:
        material = tls_key.read_bytes()
    except OSError:
        return secrets.token_bytes(32)
    return hmac.new(material, b"trainingrun.dev job signature v1", hashlib.sha256).digest()


def _flag(env: Any, name: str) -> bool:
    """A true/false setting (empty: false); anything else is refused, naming it."""
    raw = (env.get(name) or "false").strip().lower()
    if raw not in ("true", "false"):
        raise ValueError(f"{name}={env.get(name)!r} must be true or false")
    return raw == "true"
