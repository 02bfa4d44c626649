"""The TrainingRun API (trainingrun.dev/v1alpha1): the single source of truth.

The CRD in manifests/crds/ and charts/*/crds/ is generated from these models (see `crd.py`), the
builders read them, and `trainingrun validate` checks files against them. A rule that the API
server must also enforce is written twice on purpose: as a pydantic validator (for `validate` and
the operator) and as a CEL rule in `x-kubernetes-validations` (for `kubectl apply`); the tests run
every invalid example through both.

Slightly over 500 lines: the whole user-facing API in one file, as `kubectl explain` shows it, is easier to
review than the same models spread over several.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from trainingrun_api import contract, progress_report
from trainingrun_api.checkpoint_config import CheckpointConfig
from trainingrun_api.config import TrainerConfig
from trainingrun_api.model_base import ApiModel

from . import scheduling
from .scheduling import (
    DNS_SUBDOMAIN,
    LABEL_VALUE,
    Affinity,
    Annotations,
    Labels,
    NodeSelectorLabels,
    PodLabels,
    Toleration,
)

GROUP = "trainingrun.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TrainingRun"
PLURAL = "trainingruns"
SINGULAR = "trainingrun"
SHORT_NAMES = ["tr"]

# Children are named <run>-a<attempt> (PyTorchJob) and Kubeflow names pods and Services
# <job>-worker-<index>; a Service name is a DNS-1035 label of at most 63 characters. 40 leaves room
# for an attempt of up to 4 digits and a replica index of up to 5 digits: 40+2+4+8+5 = 59.
MAX_RUN_NAME_LENGTH = 40
RUN_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
#: A DNS label (RFC 1123), as the API server checks namespaces.
NAMESPACE_PATTERN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
MAX_REPLICAS = 10000
MAX_ATTEMPT_BUDGET = 1000

#: A Secret (or ConfigMap) key: letters, digits, '-', '_', '.'; not '.', '..' or anything starting with '..'.
SECRET_KEY = r"^([-_a-zA-Z0-9]|\.[-_a-zA-Z0-9])[-._a-zA-Z0-9]*$"
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
QUANTITY = r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]+))?$"
#: A device plugin's extended resource: fully qualified (domain/name), so never cpu, memory or another standard one.
EXTENDED_RESOURCE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$"
# Environment names the operator sets itself; a user value would silently break the contract.
RESERVED_ENV_PREFIXES = (contract.PREFIX, "PET_")
RESERVED_ENV_NAMES = {
    "GOOGLE_APPLICATION_CREDENTIALS",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
}


# Lists of named items are maps for the API server: it rejects a name given twice.
_LIST_MAP_BY_NAME = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}


# A file:// path is on each pod's own disk: several pods would each hold a part of every checkpoint.
FILE_URI_ONE_POD = (
    "a file:// checkpoint is local to each pod (and without checkpoint.uri, checkpoints go to the pod's "
    "own disk), so a run of several pods could not resume from it; set checkpoint.uri to gs:// or "
    "s3://, or set replicas.min and replicas.max to 1"
)


def _reserved_env_rule(list_path: str) -> tuple[str, str]:
    names = ", ".join(f"'{n}'" for n in sorted(RESERVED_ENV_NAMES))
    prefixes = " || ".join(f"e.name.startsWith('{p}')" for p in RESERVED_ENV_PREFIXES)
    return (
        # env lists have no default: a rule that reads an absent field fails, so guard with has().
        f"!has(self.{list_path}) || self.{list_path}.all(e, !({prefixes} || e.name in [{names}]))",
        f"{list_path}: names starting with TRAININGRUN_ or PET_ and storage credential variables are set "
        "by the operator; choose another name (credentials go in secrets.gcsKeyFile or secrets.s3Credentials)",
    )


def _cel(*rules: tuple[str, str]) -> ConfigDict:
    """Model config that carries CEL rules into the generated CRD schema."""
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]})


class Replicas(ApiModel):
    """How many pods (nodes) the elastic job may run; the job starts once `min` pods are ready."""

    model_config = _cel(
        ("!has(self.max) || self.min <= self.max", "replicas.min must be <= replicas.max; raise max or lower min")
    )

    min: int = Field(default=1, ge=1, le=MAX_REPLICAS, description="Fewest pods the job runs with.")
    max: Optional[int] = Field(
        default=None,
        ge=1,
        le=MAX_REPLICAS,
        description="Most pods the job scales to; defaults to min (a fixed-size job).",
    )

    @model_validator(mode="after")
    def _ordered(self) -> "Replicas":
        if self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) is greater than max ({self.max}); raise max or lower min")
        return self

    @property
    def effective_max(self) -> int:
        return self.max if self.max is not None else self.min


class Resources(ApiModel):
    """Per-pod compute. CPU and memory are requests (memory is also the limit); GPUs are whole devices."""

    gpu: int = Field(default=0, ge=0, le=16, description="GPUs per pod, requested as gpuResourceName.")
    gpu_resource_name: str = Field(
        default="nvidia.com/gpu",
        pattern=EXTENDED_RESOURCE,
        max_length=253,
        description="Extended resource name of the GPU device plugin (domain/name, e.g. nvidia.com/gpu, amd.com/gpu).",
    )
    cpu: Optional[str] = Field(
        default=None, pattern=QUANTITY, max_length=64, description="CPU request per pod, e.g. '8' or '7500m'."
    )
    memory: Optional[str] = Field(
        default=None,
        pattern=QUANTITY,
        max_length=64,
        description="Memory request and limit per pod, e.g. '64Gi'.",
    )
    shared_memory: str = Field(
        default="1Gi",
        pattern=QUANTITY,
        max_length=64,
        description="Size of the in-memory /dev/shm volume that DataLoader workers and NCCL use, where "
        "checkpoint.writerProcess stages each rank's state and where checkpoint.memoryTier keeps the newest checkpoint "
        "of the pod's ranks (each needs about one copy of the pod's ranks' state; without room, saves are written "
        "in-process and not kept in memory, with a warning).",
    )


class SecretKeyRef(ApiModel):
    """One key of a Secret in the run's namespace. The operator never reads its value."""

    secret_name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253, description="Name of the Secret.")
    key: str = Field(pattern=SECRET_KEY, min_length=1, max_length=253, description="Key within the Secret.")


class S3Credentials(ApiModel):
    """A Secret with S3 access keys, exposed to the trainer as AWS_* variables."""

    secret_name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253, description="Name of the Secret.")
    access_key_id_key: str = Field(
        default="AWS_ACCESS_KEY_ID", pattern=SECRET_KEY, max_length=253, description="Key holding the access key id."
    )
    secret_access_key_key: str = Field(
        default="AWS_SECRET_ACCESS_KEY",
        pattern=SECRET_KEY,
        max_length=253,
        description="Key holding the secret access key.",
    )
    session_token_key: Optional[str] = Field(
        default=None, pattern=SECRET_KEY, max_length=253, description="Key holding a session token, if any."
    )


class SecretEnv(ApiModel):
    """An environment variable whose value comes from a Secret key (tracker API keys and the like)."""

    name: str = Field(pattern=ENV_NAME, max_length=128, description="Variable name, e.g. WANDB_API_KEY.")
    secret_name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253, description="Name of the Secret.")
    key: str = Field(pattern=SECRET_KEY, min_length=1, max_length=253, description="Key within the Secret.")


class Secrets(ApiModel):
    """Credentials by reference only. With neither storage secret, pods use workload identity."""

    gcs_key_file: Optional[SecretKeyRef] = Field(
        default=None,
        description="A GCP service-account key file; mounted read-only and named by GOOGLE_APPLICATION_CREDENTIALS.",
    )
    s3_credentials: Optional[S3Credentials] = Field(
        default=None, description="S3 access keys, passed as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY."
    )
    env: list[SecretEnv] = Field(
        default_factory=list,
        max_length=64,
        description="More variables from Secret keys.",
        json_schema_extra=_LIST_MAP_BY_NAME,
    )

    def secret_names(self) -> list[str]:
        """Every Secret the trainer pods read, each once, in the order the spec names them."""
        refs = [self.gcs_key_file, self.s3_credentials, *self.env]
        return list(dict.fromkeys(r.secret_name for r in refs if r is not None))


class EnvVar(ApiModel):
    """A plain (non-secret) environment variable for the trainer containers."""

    name: str = Field(pattern=ENV_NAME, max_length=128, description="Variable name.")
    value: str = Field(default="", max_length=32768, description="Value. Never put secrets here; use secrets.env.")


class Recovery(ApiModel):
    """Restart budgets and timing. Preemptions and failures are counted separately."""

    model_config = _cel(
        (
            "self.backoffSeconds <= self.maxBackoffSeconds",
            "recovery.backoffSeconds must be <= recovery.maxBackoffSeconds",
        )
    )

    max_failures: int = Field(
        default=3,
        ge=0,
        le=MAX_ATTEMPT_BUDGET,
        description="Failed attempts (crash, OOM, stall) tolerated before the run fails.",
    )
    max_preemptions: int = Field(
        default=20,
        ge=0,
        le=MAX_ATTEMPT_BUDGET,
        description="Preempted attempts (node drain, spot reclaim, SIGTERM) tolerated before the run fails.",
    )
    backoff_seconds: int = Field(
        default=10, ge=0, le=3600, description="Wait before the first retry; doubles with each retry."
    )
    max_backoff_seconds: int = Field(default=600, ge=0, le=86400, description="Cap on the retry wait.")
    stall_timeout_seconds: int = Field(
        default=1800,
        ge=0,
        le=7 * 86400,
        description="Restart an attempt whose progress has not moved for this long; 0 turns it off.",
    )
    max_restarts_per_attempt: int = Field(
        default=3,
        ge=0,
        le=100,
        description="In-place worker-group restarts torchrun may do in a row within one attempt "
        "(elasticPolicy.maxRestarts); a group that committed a checkpoint since the last restart gets them "
        "all back, so only a crash loop ends the attempt.",
    )

    @model_validator(mode="after")
    def _backoff_ordered(self) -> "Recovery":
        if self.backoff_seconds > self.max_backoff_seconds:
            raise ValueError(
                f"backoffSeconds ({self.backoff_seconds}) is greater than maxBackoffSeconds "
                f"({self.max_backoff_seconds}); lower backoffSeconds or raise maxBackoffSeconds"
            )
        return self


class Metrics(ApiModel):
    """The Prometheus endpoint every trainer rank serves."""

    enabled: bool = Field(default=True, description="Serve metrics and expose the port.")
    model_config = _cel(
        (
            f"self.port != {contract.RENDEZVOUS_PORT}",
            f"metrics.port {contract.RENDEZVOUS_PORT} is the Kubeflow rendezvous port in every pod; "
            "choose another port",
        )
    )

    port: int = Field(default=9464, ge=1024, le=65535, description="Port of the metrics endpoint.")

    @field_validator("port")
    @classmethod
    def _not_rendezvous(cls, port: int) -> int:
        if port == contract.RENDEZVOUS_PORT:
            raise ValueError(
                f"{port} is the port the Kubeflow Training Operator gives the rendezvous in every pod; "
                "choose another port (the default is 9464)"
            )
        return port


class TrainingRunSpec(ApiModel):
    """What to train, where to checkpoint, how many pods, and how to recover from failures."""

    model_config = _cel(
        (
            "self.resources.gpu == 0 || self.nprocPerNode <= self.resources.gpu",
            "nprocPerNode must be <= resources.gpu: each process drives one GPU",
        ),
        (
            "self.trainer.precision != '16-mixed' || self.resources.gpu > 0",
            "trainer.precision 16-mixed needs a GPU: set resources.gpu or use bf16-mixed",
        ),
        _reserved_env_rule("env"),
        _reserved_env_rule("secrets.env"),
        (
            "!has(self.env) || !has(self.secrets.env) || "
            "self.env.all(e, !self.secrets.env.exists(s, s.name == e.name))",
            "a variable is set in both env and secrets.env; set each variable once",
        ),
        (
            "!self.checkpoint.uri.startsWith('file://') || !has(self.replicas) || "
            "(self.replicas.min == 1 && (!has(self.replicas.max) || self.replicas.max == 1))",
            FILE_URI_ONE_POD,
        ),
    )

    image: Optional[str] = Field(
        default=None,
        pattern=r"^\S+$",
        max_length=1024,
        description="Trainer image. Defaults to the trainer image the operator was installed with.",
    )
    image_pull_policy: Optional[Literal["Always", "IfNotPresent", "Never"]] = Field(
        default=None, description="Image pull policy of the trainer container."
    )
    image_pull_secrets: list[Annotated[str, Field(pattern=DNS_SUBDOMAIN, max_length=253)]] = Field(
        default_factory=list, max_length=16, description="Names of registry Secrets for a private image."
    )
    command: Optional[list[str]] = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="Container command. Defaults to torchrun's elastic agent (through "
        "`python -m trainingrun_trainer.launch`, which keeps exit codes meaningful) running `trainingrun_trainer`.",
    )
    args: Optional[list[str]] = Field(default=None, max_length=256, description="Container arguments.")
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig,
        description="The trainer config, mounted into every pod from a ConfigMap.",
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig,
        description="Checkpoint storage, frequency and retention (without it: the pod's own disk, one-pod runs only).",
    )
    replicas: Replicas = Field(default_factory=Replicas, description="Elastic pod count.")
    nproc_per_node: int = Field(default=1, ge=1, le=64, description="Training processes per pod.")
    resources: Resources = Field(default_factory=Resources, description="Per-pod compute.")
    secrets: Secrets = Field(default_factory=Secrets, description="Credentials, by reference only.")
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=128,
        description="Plain environment variables.",
        json_schema_extra=_LIST_MAP_BY_NAME,
    )
    recovery: Recovery = Field(default_factory=Recovery, description="Restart budgets and timing.")
    metrics: Metrics = Field(default_factory=Metrics, description="Trainer metrics endpoint.")
    suspend: bool = Field(default=False, description="Stop the pods (keeping checkpoints); false resumes.")
    active_deadline_seconds: Optional[int] = Field(
        default=None, ge=1, description="Fail an attempt that runs longer than this."
    )
    queue_name: Optional[str] = Field(
        default=None,
        pattern=LABEL_VALUE,
        max_length=63,
        description="Kueue LocalQueue; set as the kueue.x-k8s.io/queue-name label of the PyTorchJob.",
    )
    node_selector: NodeSelectorLabels = Field(
        default_factory=dict,
        max_length=scheduling.MAX_MAP_ENTRIES,
        description="Node labels the pods require.",
        json_schema_extra=scheduling.label_map_schema("nodeSelector"),
    )
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64, description="Pod tolerations.")
    affinity: Optional[Affinity] = Field(default=None, description="Pod affinity, as in a pod spec.")
    priority_class_name: Optional[str] = Field(
        default=None, pattern=DNS_SUBDOMAIN, max_length=253, description="PriorityClass of the pods."
    )
    service_account_name: Optional[str] = Field(
        default=None,
        pattern=DNS_SUBDOMAIN,
        max_length=253,
        description="Run pods as this existing ServiceAccount (e.g. one bound to a cloud identity); "
        "the operator grants it status reporting for this run. Defaults to a per-run ServiceAccount.",
    )
    pod_labels: PodLabels = Field(
        default_factory=dict,
        max_length=scheduling.MAX_MAP_ENTRIES,
        description="Extra labels on the pods.",
        json_schema_extra=scheduling.label_map_schema("podLabels", reserved=True),
    )
    pod_annotations: Annotations = Field(
        default_factory=dict,
        max_length=scheduling.MAX_MAP_ENTRIES,
        description="Extra annotations on the pods.",
        json_schema_extra=scheduling.annotation_map_schema("podAnnotations"),
    )
    termination_grace_period_seconds: int = Field(
        default=300,
        ge=30,
        le=3600,
        description="Time between SIGTERM and SIGKILL; the trainer writes an emergency checkpoint in it.",
    )

    @model_validator(mode="after")
    def _cross_field(self) -> "TrainingRunSpec":
        if self.resources.gpu and self.nproc_per_node > self.resources.gpu:
            raise ValueError(
                f"nprocPerNode ({self.nproc_per_node}) is greater than resources.gpu ({self.resources.gpu}); "
                "each process drives one GPU: lower nprocPerNode or raise resources.gpu"
            )
        if self.trainer.precision == "16-mixed" and not self.resources.gpu:
            raise ValueError("trainer.precision 16-mixed needs a GPU: set resources.gpu or use bf16-mixed")
        if self.checkpoint.uri.startswith("file://") and self.replicas.effective_max > 1:
            raise ValueError(
                f"checkpoint.uri {self.checkpoint.uri} with up to {self.replicas.effective_max} pods: "
                + FILE_URI_ONE_POD
            )
        names: dict[str, str] = {}
        for where, name in [(f"env[{i}]", e.name) for i, e in enumerate(self.env)] + [
            (f"secrets.env[{i}]", e.name) for i, e in enumerate(self.secrets.env)
        ]:
            if name in RESERVED_ENV_NAMES or name.startswith(RESERVED_ENV_PREFIXES):
                raise ValueError(
                    f"{where}.name {name} is set by the operator; choose another name "
                    "(storage credentials go in secrets.gcsKeyFile or secrets.s3Credentials)"
                )
            if name in names:
                raise ValueError(f"{where}.name {name} is already set by {names[name]}; set each variable once")
            names[name] = where
        return self


# ---------------------------------------------------------------- status

Phase = Literal["Pending", "Running", "Recovering", "Suspended", "Succeeded", "Failed"]


def status_part(part: type[progress_report.ReportPart], name: str, **derived: Any) -> type[ApiModel]:
    """The status model of a report part (`contract`), generated from it so the two cannot drift apart: the same
    names and descriptions, each optional (status may hold what an older trainer reported; a field with a default
    keeps it), plus the fields the operator `derived` itself. A report is checked once, by the contract's model;
    status is written from that."""
    fields: dict[str, Any] = {}
    for field, info in part.model_fields.items():
        kept = not info.is_required() and info.default is not None
        annotation = info.annotation if kept else Optional[info.annotation]
        fields[field] = (annotation, Field(default=info.default if kept else None, description=info.description))
    model: type[ApiModel] = create_model(name, __base__=ApiModel, __doc__=part.__doc__, **fields, **derived)
    return model


Progress = status_part(
    progress_report.Progress,
    "Progress",
    percent=(
        Optional[float],
        Field(default=None, description="step / totalSteps in percent (the operator computes it from the report)."),
    ),
    estimated_completion_time=(
        Optional[str],
        Field(
            default=None,
            description="When the run reaches totalSteps at the step rate between the last two reports "
            "of this attempt (RFC 3339; the operator computes it).",
        ),
    ),
)

#: Progress fields the operator derives from reports; a report cannot set them.
DERIVED_PROGRESS_FIELDS = ("percent", "estimatedCompletionTime")

CheckpointRef = status_part(progress_report.CommittedCheckpoint, "CheckpointRef")
CheckpointInMemoryRef = status_part(progress_report.CheckpointInMemory, "CheckpointInMemoryRef")


class Restarts(ApiModel):
    """Attempts restarted, by cause, and pods restarted within attempts."""

    failures: int = Field(default=0, description="Attempts lost to application failures and stalls.")
    preemptions: int = Field(default=0, description="Attempts lost to preemption or eviction.")
    total: int = Field(default=0, description="failures + preemptions.")
    in_place: int = Field(
        default=0,
        description="Times the Kubeflow Training Operator restarted pods within an attempt (a pod deleted, evicted or "
        "exited retryably); they rejoin and resume from the last checkpoint, no new attempt is charged.",
    )
    last_in_place_time: Optional[str] = Field(
        default=None, description="When the PyTorchJob last reported Restarting (RFC 3339): the last restart counted."
    )
    backoff_seconds: float = Field(default=0.0, description="Seconds of backoff before the attempts after the first.")


ProcessTimes = status_part(progress_report.ProcessTime, "ProcessTimes")


class TimeAccount(ApiModel):
    """The operator's account of the processes' time, kept across processes: one that reports after another adds
    the other's last report to `ended`."""

    ended: Optional[ProcessTimes] = Field(default=None, description="Processes of this run that ended, summed.")
    current: Optional[ProcessTimes] = Field(default=None, description="The newest report's process.")


class TimeBreakdown(ApiModel):
    """The run's wall time since startTime, at the last report, by part; the parts add up to wallSeconds."""

    wall_seconds: float = Field(default=0.0, description="From startTime to the last report.")
    productive_seconds: float = Field(default=0.0, description="Step compute kept in the model.")
    lost_seconds: float = Field(default=0.0, description="Step compute thrown away by crashes and rollbacks.")
    startup_seconds: float = Field(
        default=0.0,
        description="Starting processes (imports, rendezvous, model, data) and every moment no training "
        "process reported: scheduling, image pulls, pods restarting, a killed process after its last report.",
    )
    restore_seconds: float = Field(default=0.0, description="Loading checkpoints.")
    checkpoint_seconds: float = Field(default=0.0, description="Training blocked by saves.")
    data_wait_seconds: float = Field(default=0.0, description="Steps waiting for input.")
    eval_seconds: float = Field(default=0.0, description="Evaluations.")
    backoff_seconds: float = Field(default=0.0, description="Waiting out backoffs between attempts.")
    other_seconds: float = Field(default=0.0, description="The rest: logging, metrics and reporting between steps.")


CheckpointIntervalChoice = status_part(progress_report.IntervalChoice, "CheckpointIntervalChoice")


class Condition(ApiModel):
    """A Kubernetes-style condition."""

    type: str = Field(description="Condition type, e.g. Ready, SecretMissing.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: Optional[str] = Field(default=None, description="CamelCase reason for the last transition.")
    message: Optional[str] = Field(default=None, description="Human-readable details.")
    last_transition_time: Optional[str] = Field(default=None, description="When status last changed (RFC 3339).")
    observed_generation: Optional[int] = Field(default=None, description="Spec generation the condition is based on.")


class TrainingRunStatus(ApiModel):
    """Observed state, written by the operator alone (progress and checkpoints as rank 0 reported them to it)."""

    phase: Optional[Phase] = Field(
        default=None, description="Pending, Running, Recovering, Suspended, Succeeded or Failed."
    )
    attempt: Optional[int] = Field(default=None, description="Current attempt number, from 1.")
    job_name: Optional[str] = Field(default=None, description="PyTorchJob of the current attempt.")
    start_time: Optional[str] = Field(default=None, description="When the first attempt started (RFC 3339).")
    attempt_start_time: Optional[str] = Field(default=None, description="When the current attempt started (RFC 3339).")
    next_attempt_time: Optional[str] = Field(
        default=None, description="While Recovering or Suspended-then-resumed: when the next attempt starts (RFC 3339)."
    )
    checkpoint_uri: Optional[str] = Field(
        default=None, description="The checkpoint URI the run started with; it cannot change while the run is active."
    )
    completion_time: Optional[str] = Field(default=None, description="When the run succeeded or failed (RFC 3339).")
    progress: Optional[Progress] = Field(default=None, description="Training progress.")
    last_good_checkpoint: Optional[CheckpointRef] = Field(
        default=None, description="Newest committed checkpoint in storage: where a new attempt resumes from."
    )
    checkpoint_in_memory: Optional[CheckpointInMemoryRef] = Field(
        default=None,
        description="With checkpoint.persistBehind: the newest checkpoint committed in the pod's memory "
        "(ahead of lastGoodCheckpoint until storage holds it; a restart of the workers inside the pod resumes from it, "
        "a new pod from lastGoodCheckpoint). Cleared when an attempt starts: a new pod's memory is empty.",
    )
    last_report_time: Optional[str] = Field(
        default=None,
        description="When the operator last accepted a report from the current attempt (RFC 3339); "
        "rank 0 reports every 10 s, also when nothing changed.",
    )
    restarts: Optional[Restarts] = Field(default=None, description="Restarts by cause.")
    goodput: Optional[float] = Field(
        default=None, description="Productive step time kept in the model divided by wall time since start."
    )
    time_breakdown: Optional[TimeBreakdown] = Field(
        default=None, description="Where the run's wall time went, at the last report (goodput's decomposition)."
    )
    process_time: Optional[TimeAccount] = Field(
        default=None, description="The training processes' own account of their time, from their reports."
    )
    checkpoint_interval: Optional[CheckpointIntervalChoice] = Field(
        default=None, description="The checkpoint interval chosen by checkpoint.interval.steps: auto."
    )
    conditions: list[Condition] = Field(default_factory=list, description="Conditions, one per type.")
    observed_generation: Optional[int] = Field(default=None, description="Spec generation last acted on.")


# ---------------------------------------------------------------- the resource


class ObjectMeta(BaseModel):
    """Kubernetes object metadata: the fields the operator uses, typed and checked as the API server checks
    them, and the rest of ObjectMeta's fields kept as they are; any other field is refused, as the API
    server's strict field validation (kubectl's default) refuses `metadata.lables`."""

    model_config = ConfigDict(extra="forbid")

    name: str
    namespace: str = "default"
    uid: Optional[str] = None
    generation: Optional[int] = None
    labels: Labels = Field(default_factory=dict)
    annotations: Annotations = Field(default_factory=dict)
    generate_name: Optional[str] = Field(default=None, alias="generateName")
    resource_version: Optional[str] = Field(default=None, alias="resourceVersion")
    creation_timestamp: Optional[str] = Field(default=None, alias="creationTimestamp")
    deletion_timestamp: Optional[str] = Field(default=None, alias="deletionTimestamp")
    deletion_grace_period_seconds: Optional[int] = Field(default=None, alias="deletionGracePeriodSeconds")
    finalizers: Optional[list[str]] = None
    owner_references: Optional[list[dict[str, Any]]] = Field(default=None, alias="ownerReferences")
    managed_fields: Optional[list[dict[str, Any]]] = Field(default=None, alias="managedFields")
    self_link: Optional[str] = Field(default=None, alias="selfLink")

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        import re

        if len(value) > 63 or not re.fullmatch(NAMESPACE_PATTERN, value, re.ASCII):
            raise ValueError(
                f"{value!r} cannot be a namespace: a namespace is a DNS label (at most 63 lowercase letters, digits "
                "and '-', starting and ending with a letter or digit), e.g. 'team-a'; the API server refuses any other"
            )
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        import re

        if len(value) > MAX_RUN_NAME_LENGTH:
            raise ValueError(
                f"'{value}' is {len(value)} characters; a TrainingRun name may have at most "
                f"{MAX_RUN_NAME_LENGTH} so that its pods and Services (<name>-a<attempt>-worker-<i>) fit in 63; "
                "choose a shorter name"
            )
        if not re.fullmatch(RUN_NAME_PATTERN, value, re.ASCII):
            raise ValueError(
                f"'{value}' is not a valid name: use lowercase letters, digits and '-', starting with a "
                "letter and ending with a letter or digit (it becomes part of Service names)"
            )
        return value


class TrainingRun(BaseModel):
    """A whole TrainingRun object as read from a file or the API."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    api_version: Literal["trainingrun.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["TrainingRun"]
    metadata: ObjectMeta
    spec: TrainingRunSpec
    status: Optional[dict[str, Any]] = None

    @classmethod
    def from_body(cls, body: Any) -> "TrainingRun":
        """Parse an API object or YAML document (raises pydantic.ValidationError)."""
        return cls.model_validate(dict(body), by_alias=True, by_name=False)
