"""The TrainingRun API (trainingrun.dev/v1alpha1): the single source of truth.

The CRD in manifests/crds/ and charts/*/crds/ is generated from these models (see `crd.py`), the
builders read them, and `trainingrun validate` checks files against them. A rule that the API
server must also enforce is written twice on purpose: as a pydantic validator (for `validate` and
the operator) and as a CEL rule in `x-kubernetes-validations` (for `kubectl apply`); the tests run
every invalid example through both.

The spec's models are here, with what goes into the containers' environment in api_env.py, the object's metadata in
api_meta.py and the status in api_status.py (generated in part from the trainer's report, so the
two cannot drift apart).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainingrun_api import contract
from trainingrun_api.checkpoint_config import CheckpointConfig
from trainingrun_api.config import TrainerConfig
from trainingrun_api.model_base import ApiModel

from . import kube_shapes
from .api_env import LIST_MAP_BY_NAME, EnvVar, Secrets
from .api_meta import ObjectMeta
from .kube_shapes import (
    DNS_SUBDOMAIN,
    LABEL_VALUE,
    Affinity,
    Annotations,
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

MAX_REPLICAS = 10000
#: What an attempt becomes (backends.py): a Kubeflow PyTorchJob, or a JobSet where Kubeflow's v1 operator is not installed.
Backend = Literal["PyTorchJob", "JobSet"]
BACKENDS: tuple[str, ...] = get_args(Backend)
MAX_ATTEMPT_BUDGET = 1000

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
        description="Size of the in-memory /dev/shm volume that DataLoader workers and NCCL use, and where "
        "checkpoint.memoryTier keeps the newest checkpoint: about one copy of the run's replicated state (model and "
        "optimizer) and of its ranks' own, up to three while persisting behind, plus 10% for DataLoader workers and "
        "NCCL. With several pods each pod holds every file of the checkpoint; a pod without room falls back to "
        "storage, with a warning.",
    )


SLOW_LOW, SLOW_HIGH = contract.SLOW_RANK_FACTORS  #: spec.recovery.slowRankFactor's factors besides 0


class Recovery(ApiModel):
    """Restart budgets and timing. Preemptions and failures are counted separately."""

    model_config = _cel(
        (
            "self.backoffSeconds <= self.maxBackoffSeconds",
            "recovery.backoffSeconds must be <= recovery.maxBackoffSeconds",
        ),
        (
            f"!has(self.slowRankFactor) || self.slowRankFactor == 0.0 || self.slowRankFactor >= {SLOW_LOW}",
            f"recovery.slowRankFactor must be 0 (off) or from {SLOW_LOW} to {SLOW_HIGH:g}; write e.g. 1.5",
        ),
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
    hang_timeout_seconds: Union[Annotated[int, Field(ge=0, le=7 * 86400)], Literal["auto"]] = Field(
        default="auto",
        description="A hang: training makes no step progress on some rank for this many seconds, outside saves, "
        "restores, evaluations and each process's first steps. `auto` (the default): 10 times the typical step "
        "time, at least 30 s. Every rank then says what it is doing (its collectives in flight and its stack), the "
        "rank that found it names the collective and the ranks that held it up in its log (`hang diagnosis:`), and "
        "the worker group restarts in place from the newest checkpoint, charged as a failure. 0 turns it off; "
        "stallTimeoutSeconds stays the outer guard (a whole pod frozen).",
    )
    slow_rank_factor: float = Field(
        default=contract.DEFAULT_SLOW_RANK_FACTOR,
        ge=0,
        le=SLOW_HIGH,
        description="A straggler: a rank whose own part of each step (its data wait and forward passes, before the "
        "step's first collective) takes this many times the other ranks' median, for 30 s in a row, while the others "
        "wait for it. It is named in status.slowRank and the condition SlowRank (its rank, pod and node, and how much "
        "slower), with a Warning Event; the run goes on. 0 turns it off; otherwise from 1.1 to 100.",
    )
    max_restarts_per_attempt: int = Field(
        default=3,
        ge=0,
        le=100,
        description="In-place worker-group restarts torchrun may do in a row within one attempt "
        "(elasticPolicy.maxRestarts); a group that committed a checkpoint since the last restart gets them "
        "all back, so only a crash loop ends the attempt.",
    )

    @field_validator("hang_timeout_seconds", mode="before")
    @classmethod
    def _seconds_or_auto(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 7 * 86400):
            return value
        raise ValueError(
            f"{value!r} is neither 'auto' nor whole seconds from 0 to a week; write e.g. 120, auto, or 0 (off)"
        )

    @field_validator("slow_rank_factor", mode="before")
    @classmethod
    def _factor_or_off(cls, value: Any) -> Any:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and (value == 0 or SLOW_LOW <= value <= SLOW_HIGH):
            return value
        raise ValueError(
            f"{value!r} is neither 0 (off) nor a factor from {SLOW_LOW} to {SLOW_HIGH:g}; write e.g. 1.5, 3, or 0"
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
        (
            "has(self.backend) == has(oldSelf.backend) && (!has(self.backend) || self.backend == oldSelf.backend)",
            "spec.backend cannot change after the run is created (its attempts' objects are of that kind): "
            "create a new TrainingRun to use another backend",
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
        description="The trainer config, a file in every pod (from a pod annotation, through a downward API volume).",
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
        json_schema_extra=LIST_MAP_BY_NAME,
    )
    recovery: Recovery = Field(default_factory=Recovery, description="Restart budgets and timing.")
    metrics: Metrics = Field(default_factory=Metrics, description="Trainer metrics endpoint.")
    suspend: bool = Field(default=False, description="Stop the pods (keeping checkpoints); false resumes.")
    active_deadline_seconds: Optional[int] = Field(
        default=None, ge=1, description="Fail an attempt that runs longer than this."
    )
    backend: Optional[Backend] = Field(
        default=None,
        description="What each attempt becomes: a Kubeflow PyTorchJob or a JobSet (jobset.x-k8s.io). Empty: the "
        "operator's default (its chart value `backend`). Cannot change once the run exists.",
    )
    queue_name: Optional[str] = Field(
        default=None,
        pattern=LABEL_VALUE,
        max_length=63,
        description="Kueue LocalQueue; set as the kueue.x-k8s.io/queue-name label of each attempt's PyTorchJob or "
        "JobSet.",
    )
    node_selector: NodeSelectorLabels = Field(
        default_factory=dict,
        max_length=kube_shapes.MAX_MAP_ENTRIES,
        description="Node labels the pods require.",
        json_schema_extra=kube_shapes.label_map_schema("nodeSelector"),
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
        max_length=kube_shapes.MAX_MAP_ENTRIES,
        description="Extra labels on the pods.",
        json_schema_extra=kube_shapes.label_map_schema("podLabels", reserved=True),
    )
    pod_annotations: Annotations = Field(
        default_factory=dict,
        max_length=kube_shapes.MAX_MAP_ENTRIES,
        description="Extra annotations on the pods.",
        json_schema_extra=kube_shapes.annotation_map_schema("podAnnotations"),
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


# ---------------------------------------------------------------- the resource


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
