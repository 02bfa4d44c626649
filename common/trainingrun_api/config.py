"""The trainer's configuration: the `spec.trainer` and `spec.checkpoint` sections of a TrainingRun.

This module imports no torch on purpose: the operator and `trainingrun validate` use these models
to check a TrainingRun before any pod or process exists. The mounted config file that a trainer pod
reads (`TRAININGRUN_CONFIG`) is a `RunConfig`: the same two sections, in the same camelCase shape
as in the TrainingRun, so a user can copy between them.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Optional, TypeVar, Union, cast

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict, JsonValue

Precision = Literal["32-true", "16-mixed", "bf16-mixed", "bf16-true"]
ScheduleName = Literal["cosine", "cosine-warm-restarts", "inverse-sqrt", "exponential", "step", "constant"]
OptimizerName = Literal["adamw", "sgd"]
Strategy = Literal["ddp", "fsdp2"]
LoggerKind = Literal["tensorboard", "mlflow", "wandb"]

CHECKPOINT_URI_PATTERN = r"^(gs|s3|file)://.+"
#: A bucket as both GCS and S3 name them: 3-222 lowercase letters, digits, '.', '-', '_'.
BUCKET_URI_PATTERN = r"^(gs|s3)://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/|$)"
#: user:password@ (or any userinfo) in a URI's authority.
CREDENTIALS_IN_URI = r"^[A-Za-z][-+.A-Za-z0-9]*://[^/]*@"
NO_CREDENTIALS = (
    "holds credentials (user:password@ before the bucket or host): remove them; give storage "
    "credentials by reference in spec.secrets (s3Credentials or gcsKeyFile)"
)
#: A checkpoint's step directory: what checkpoint.resumeFrom names.
RESUME_FROM_PATTERN = r"^(gs|s3|file)://[^\s]+/step-[0-9]{8,19}$"
RESUME_FROM_SHAPE = (
    "checkpoint.resumeFrom must be a checkpoint's step directory, gs://, s3:// or file://.../step-NNNNNNNN "
    "(`trainingrun checkpoints URI` lists them)"
)
SAME_STORAGE = "checkpoint.resumeFrom must be on the same storage as checkpoint.uri (the same scheme)"
TRACKER_CREDENTIALS = (
    "holds credentials (user:password@ before the host): remove them; give a tracker's "
    "credentials by reference in spec.secrets.env (MLFLOW_TRACKING_TOKEN, WANDB_API_KEY, AWS_* for a "
    "logDir in a bucket)"
)


#: The URI rules as CEL on the checkpoint object, not on the string: for a rule on a string (and for `pattern`)
#: the API server repeats the value in its error, and a URI may hold credentials; for an object it says "object".
class ConfigError(ValueError):
    """A trainer config that cannot work; the message names the field path and the fix.

    A ValueError, so callers that already treat bad values as permanent failures (exit code 1-127)
    treat this one the same way.
    """


#: Where a run without spec.checkpoint.uri checkpoints in a pod: its /tmp emptyDir. A trial's default, not a real run's.
POD_DISK_CHECKPOINTS = "file:///tmp/trainingrun/checkpoints"

CHECKPOINT_URI_RULES = [
    {"rule": f"!self.uri.matches(r'{CREDENTIALS_IN_URI}')", "message": f"checkpoint.uri {NO_CREDENTIALS}"},
    {"rule": "!self.uri.matches(r'\\s')", "message": "checkpoint.uri contains whitespace; remove it"},
    {
        "rule": f"self.uri.matches(r'{CHECKPOINT_URI_PATTERN}')",
        "message": "checkpoint.uri must start with gs://, s3:// or file:// (gs://bucket/path, s3://bucket/path, "
        "file:///path)",
    },
    {
        "rule": f"!self.uri.matches(r'^(gs|s3)://') || self.uri.matches(r'{BUCKET_URI_PATTERN}')",
        "message": "checkpoint.uri needs a bucket name after gs:// or s3:// (3-222 lowercase letters, digits, '.', "
        "'-'): gs://bucket/path",
    },
    {
        "rule": "!self.uri.startsWith('file://') || self.uri.startsWith('file:///')",
        "message": "checkpoint.uri: a file:// URI must be absolute: file:///path",
    },
]


def refuse_credentials(value: Any, message: str) -> Any:
    """`value`, or ValueError(`message`) when it is a URI holding credentials; for "before" validators, so the field's
    pattern check, whose message would repeat the value, never sees it."""
    if isinstance(value, str) and re.match(CREDENTIALS_IN_URI, value):
        raise ValueError(message)
    return value


def checkpoint_uri_problem(uri: str) -> Optional[str]:
    """What is wrong with a checkpoint URI, in words that never repeat credentials; None if it is fine."""
    if re.match(CREDENTIALS_IN_URI, uri):
        return NO_CREDENTIALS
    if re.search(r"\s", uri):
        return f"{uri.strip()!r} contains whitespace; remove it"
    if not re.match(CHECKPOINT_URI_PATTERN, uri):
        scheme = uri.split("://", 1)[0] if "://" in uri else ""
        found = f"scheme '{scheme}'" if scheme else "no scheme"
        return f"'{uri}' has {found}; use gs://bucket/path, s3://bucket/path or file:///path"
    if re.match(r"^(gs|s3)://", uri) and not re.match(BUCKET_URI_PATTERN, uri):
        return (
            f"'{uri}' has no valid bucket name after the scheme (3-222 lowercase letters, digits, '.', '-'); "
            "write gs://bucket/path or s3://bucket/path"
        )
    if uri.startswith("file://") and not uri.startswith("file:///"):
        return f"'{uri}' is a relative file:// URI; write it absolute: file:///path"
    return None


PYTHON_PATH_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$"


_Model = TypeVar("_Model", bound="ApiModel")


def kubernetes_validations(rules: list[dict[str, str]]) -> JsonDict:
    """A model's CEL rules (`rule`, `message`), as the CRD generator finds them in its JSON schema."""
    return {"x-kubernetes-validations": cast(list[JsonValue], rules)}


class ApiModel(BaseModel):
    """Base of every API model: camelCase on the wire, snake_case in Python, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
        # Kubernetes rejects "2" for an integer field; so do we, so `validate` agrees with the API server.
        strict=True,
    )

    @classmethod
    def from_wire(cls: type[_Model], data: Any) -> _Model:
        """Parse YAML/JSON data: camelCase names only, as the CRD accepts (snake_case is for Python)."""
        return cls.model_validate(data, by_alias=True, by_name=False)

    def to_wire(self) -> dict[str, Any]:
        """The camelCase dict form used in YAML, CRDs and the mounted config."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class Component(ApiModel):
    """A Python class built from config: `classPath` names it, `initArgs` are its keyword arguments."""

    class_path: str = Field(
        description="Dotted import path of the class, e.g. trainingrun_trainer.models.CharTransformer. "
        "A class from a package installed in a derived image works the same way.",
        pattern=PYTHON_PATH_PATTERN,
        max_length=253,
    )
    init_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments passed to the class's constructor.",
    )

    @field_validator("class_path", mode="before")
    @classmethod
    def _dotted_path(cls, value: Any) -> Any:
        if isinstance(value, str) and not re.fullmatch(PYTHON_PATH_PATTERN, value, re.ASCII):
            raise ValueError(f"'{value}' is not a dotted Python path; write it as package.module.ClassName")
        return value


def default_model() -> Component:
    return Component(class_path="trainingrun_trainer.models.CharTransformer")


def default_dataset() -> Component:
    return Component(class_path="trainingrun_trainer.data.SyntheticText")


class DataConfig(ApiModel):
    """Where batches come from and how they are cut."""

    model_config = ConfigDict(
        json_schema_extra=kubernetes_validations(
            [
                {
                    "rule": "!has(self.prefetchFactor) || self.numWorkers > 0",
                    "message": "prefetchFactor needs worker processes: set numWorkers (e.g. 2), or remove prefetchFactor",
                }
            ]
        )
    )

    dataset: Component = Field(
        default_factory=default_dataset,
        description="The dataset class; it is built once per split ('train' and 'eval') with `split` "
        "added to initArgs. Defaults to the seeded synthetic text dataset that ships with the trainer.",
    )
    batch_size: int = Field(
        default=32, ge=1, le=65536, description="Samples per process per micro-step (before accumulation)."
    )
    num_workers: int = Field(
        default=0,
        ge=0,
        le=64,
        description="DataLoader worker processes per rank; each is seeded. 0: batches are "
        "made in the training process, by a thread two batches ahead for the built-in datasets (and any whose class "
        "sets pure_items = True: items that depend on their index alone), else on the training thread. With heavy "
        "decoding or augmentation, 2-4 keep up with a GPU (watch trainingrun_data_wait_seconds).",
    )
    prefetch_factor: Optional[int] = Field(
        default=None,
        ge=1,
        le=64,
        description="Batches each worker loads ahead (PyTorch's default 2); needs numWorkers > 0.",
    )
    pin_memory: bool = Field(
        default=False,
        description="Batches in page-locked host memory, so the copy to the GPU overlaps compute "
        "(CUDA only; ignored on CPU).",
    )

    @model_validator(mode="after")
    def _prefetch_needs_workers(self) -> "DataConfig":
        if self.prefetch_factor is not None and self.num_workers == 0:
            raise ValueError("prefetchFactor needs worker processes: set numWorkers (e.g. 2), or remove prefetchFactor")
        return self


class OptimizerConfig(ApiModel):
    """The optimizer and its weight-decay groups."""

    name: OptimizerName = Field(default="adamw", description="Optimizer: adamw or sgd.")
    lr: float = Field(default=3e-4, gt=0, le=10, description="Peak learning rate (after warmup).")
    weight_decay: float = Field(default=0.01, ge=0, le=1, description="Decoupled weight decay.")
    no_decay_for_bias_and_norm: bool = Field(
        default=True,
        description="Exclude biases and normalization weights from weight decay (a second param group).",
    )
    beta1: float = Field(default=0.9, ge=0, lt=1, description="AdamW first-moment decay.")
    beta2: float = Field(default=0.95, ge=0, lt=1, description="AdamW second-moment decay.")
    eps: float = Field(default=1e-8, gt=0, le=1, description="AdamW epsilon.")
    momentum: float = Field(default=0.9, ge=0, lt=1, description="SGD momentum.")
    fused: Optional[bool] = Field(
        default=None,
        description="AdamW's fused kernel (one kernel per step for all parameters). Unset: on with "
        "GPUs (on an H100, fused AdamW with TF32 matmuls took the benchmark model from 35.9 to 31.7 ms a step), off "
        "on CPUs. Results differ from the unfused AdamW in the last bits; a run resumes exactly either way.",
    )


class ScheduleConfig(ApiModel):
    """Learning-rate schedule, applied per optimizer step after an optional linear warmup."""

    name: ScheduleName = Field(
        default="cosine",
        description="cosine (to minLrRatio at maxSteps), cosine-warm-restarts (SGDR), inverse-sqrt, "
        "exponential (gamma per step), step (gamma every stepSize steps) or constant.",
    )
    warmup_steps: int = Field(default=0, ge=0, description="Linear warmup from 0 to the peak LR.")
    min_lr_ratio: float = Field(
        default=0.1, ge=0, le=1, description="Floor of cosine schedules as a fraction of the peak LR."
    )
    restart_period_steps: int = Field(default=1000, ge=1, description="cosine-warm-restarts: steps in the first cycle.")
    restart_period_mult: int = Field(
        default=1, ge=1, le=16, description="cosine-warm-restarts: each cycle is this many times longer."
    )
    gamma: float = Field(
        default=0.1,
        gt=0,
        le=1,
        description="Decay factor: per step for exponential, every stepSize steps for step.",
    )
    step_size: int = Field(default=1000, ge=1, description="step: steps between decays.")


class EmaConfig(ApiModel):
    """Exponential moving average of the weights, kept alongside the model and checkpointed."""

    enabled: bool = Field(default=False, description="Keep an EMA copy of the weights.")
    decay: float = Field(default=0.999, gt=0, lt=1, description="EMA decay per optimizer step.")


class EvalConfig(ApiModel):
    """Periodic evaluation on the held-out split."""

    interval_steps: int = Field(default=0, ge=0, description="Evaluate every this many steps; 0 turns evaluation off.")
    batches: int = Field(default=10, ge=1, le=100000, description="Batches per evaluation.")


#: (kind, its required field, the field as written, what that field is): each kind's one required field.
#: What each kind of logger needs: (kind, field, its name on the wire, what it is).
LOGGER_NEEDS = (
    ("tensorboard", "log_dir", "logDir", "a path or gs://, s3:// URI for its event files"),
    ("mlflow", "tracking_uri", "trackingUri", "the MLflow tracking server, e.g. http://mlflow.mlflow:5000"),
    ("wandb", "project", "project", "the W&B project the run is logged to"),
)
#: The kinds of logger each field is for: (field, its name on the wire, kinds).
LOGGER_FIELD_KINDS = (
    ("log_dir", "logDir", ("tensorboard", "wandb")),
    ("tracking_uri", "trackingUri", ("mlflow",)),
    ("experiment", "experiment", ("mlflow",)),
    ("project", "project", ("wandb",)),
    ("entity", "entity", ("wandb",)),
)


def _only_for(wire: str, kinds: tuple[str, ...]) -> str:
    return f"{wire} is for {' and '.join(kinds)} loggers only; remove it"


class LoggerConfig(ApiModel):
    """An experiment tracker the trainer logs to: rank 0 only, from a background queue that never holds a step.

    One tracked run per TrainingRun across attempts and restarts; steps a resumed run computes again are not logged
    twice. Credentials come only from Secrets by reference (spec.secrets.env: MLFLOW_TRACKING_TOKEN, or
    MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD; WANDB_API_KEY; AWS_* or GOOGLE_APPLICATION_CREDENTIALS for
    a logDir in a bucket). W&B's own variables (WANDB_MODE=offline, WANDB_BASE_URL) go in spec.env.
    """

    model_config = ConfigDict(
        json_schema_extra=kubernetes_validations(
            [
                {
                    "rule": f"self.kind != '{kind}' || has(self.{wire})",
                    "message": f"a {kind} logger needs {wire}: {what}",
                }
                for kind, _, wire, what in LOGGER_NEEDS
            ]
            + [
                {"rule": f"self.kind in {list(kinds)} || !has(self.{wire})", "message": _only_for(wire, kinds)}
                for _, wire, kinds in LOGGER_FIELD_KINDS
            ]
            + [  # on the object, not the string: a rule on a string repeats its value in the server's error
                {
                    "rule": f"!has(self.{wire}) || !self.{wire}.matches(r'{CREDENTIALS_IN_URI}')",
                    "message": f"{wire} {TRACKER_CREDENTIALS}",
                }
                for wire in ("logDir", "trackingUri")
            ]
        )
    )

    kind: LoggerKind = Field(
        description="tensorboard: event files under logDir; mlflow: a run on an MLflow "
        "tracking server; wandb: a run on Weights & Biases."
    )
    log_dir: Optional[str] = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="tensorboard: the directory of this run's event files (a path, "
        "or a gs:// or s3:// URI through fsspec). Give each TrainingRun its own. wandb: W&B's local directory (a "
        "path; default the temporary directory), where offline runs (WANDB_MODE=offline) are kept.",
    )
    tracking_uri: Optional[str] = Field(
        default=None, min_length=1, max_length=1024, description="mlflow: the tracking server (http:// or https://)."
    )
    experiment: Optional[str] = Field(
        default=None,
        min_length=1,
        max_length=500,
        description="mlflow: the experiment the run is logged under "
        "(created when missing). Default: the TrainingRun's namespace.",
    )
    project: Optional[str] = Field(
        default=None, min_length=1, max_length=128, description="wandb: the project the run is logged to."
    )
    entity: Optional[str] = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="wandb: the team or user that owns the project (default: the API key's user).",
    )

    @field_validator("log_dir", "tracking_uri", mode="before")
    @classmethod
    def _no_credentials(cls, value: Any) -> Any:
        return refuse_credentials(value, TRACKER_CREDENTIALS)

    @model_validator(mode="after")
    def _each_kind_its_fields(self) -> "LoggerConfig":
        for kind, field, wire, what in LOGGER_NEEDS:
            if self.kind == kind and getattr(self, field) is None:
                raise ValueError(f"a {kind} logger needs {wire}: {what}")
        for field, wire, kinds in LOGGER_FIELD_KINDS:
            if self.kind not in kinds and getattr(self, field) is not None:
                raise ValueError(_only_for(wire, kinds))
        return self


class HealthConfig(ApiModel):
    """What the trainer does when loss or gradients stop being finite."""

    max_consecutive_non_finite: int = Field(
        default=3,
        ge=1,
        le=10000,
        description="Skip non-finite steps; after this many in a row, roll back to the last good checkpoint.",
    )
    rollback_lr_scale: float = Field(
        default=0.5, gt=0, le=1, description="Multiply the learning rate by this after each rollback."
    )
    max_rollbacks: int = Field(
        default=2,
        ge=0,
        le=100,
        description="After this many rollbacks the trainer stops with a permanent exit code.",
    )


class TrainerConfig(ApiModel):
    """Everything about the training loop: model, data, optimizer, schedule, precision and practices."""

    model: Component = Field(
        default_factory=default_model,
        description="The model class; defaults to the small character-level transformer that ships with the trainer.",
    )
    data: DataConfig = Field(default_factory=DataConfig, description="Dataset and batching.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="Learning-rate schedule.")
    max_steps: int = Field(default=1000, ge=1, le=10**9, description="Optimizer steps to train for.")
    grad_accumulation_steps: int = Field(
        default=1, ge=1, le=4096, description="Micro-batches accumulated into each optimizer step."
    )
    grad_clip_norm: Optional[float] = Field(
        default=1.0, gt=0, description="Clip the global gradient norm to this; null turns clipping off."
    )
    precision: Precision = Field(
        default="32-true",
        description="32-true, 16-mixed (fp16 autocast with a grad scaler; needs a GPU), bf16-mixed or bf16-true.",
    )
    strategy: Strategy = Field(
        default="ddp", description="ddp (replicated weights) or fsdp2 (sharded with fully_shard)."
    )
    activation_checkpointing: bool = Field(
        default=False, description="Recompute activations in the backward pass to save memory."
    )
    compile: Optional[bool] = Field(
        default=None,
        description="Wrap the model with torch.compile. Unset: on with GPUs (the benchmark model on an "
        "H200: 25.8 -> 20.7 ms a step), where a model that fails to compile trains uncompiled with a warning; off on "
        "CPUs. The first start of an attempt compiles (tens of seconds); a worker restarted in its pod finds the "
        "cache in the pod's /tmp. true: compile also on CPUs, and a compile error ends the run.",
    )
    tf32: Optional[bool] = Field(
        default=None,
        description="Run float32 matmuls and convolutions on GPUs in TF32 (10-bit mantissa inputs, "
        "float32 accumulation): the tensor cores' 32-bit path, several times float32's peak. Unset: on with GPUs. "
        "Matters for precision 32-true and the float32 parts of mixed precision.",
    )
    flops_per_sample: Optional[int] = Field(
        default=None,
        ge=1,
        description="Forward and backward FLOPs of one sample, for model FLOP/s and MFU; wins over "
        "the model's own flops_per_sample() method (the built-in models have one). Neither: no FLOP figures.",
    )
    peak_flops_per_second: Optional[float] = Field(
        default=None,
        gt=0,
        description="One device's dense peak FLOP/s at this precision, for MFU; by default taken "
        "from the trainer's table of GPUs by device name (H100, H200, B200, A100, L40S, L4, A10G...). A GPU the table "
        "lacks, and any CPU, report model FLOP/s and no MFU unless this is set.",
    )
    seed: int = Field(default=0, ge=0, le=2**32 - 1, description="Seeds python, numpy, torch and DataLoader workers.")
    deterministic: bool = Field(
        default=False,
        description="Use deterministic algorithms only, so a resumed run matches an uninterrupted one bit for bit.",
    )
    ema: EmaConfig = Field(default_factory=EmaConfig, description="Weight EMA.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Periodic evaluation.")
    health: HealthConfig = Field(default_factory=HealthConfig, description="Non-finite loss policy.")
    loggers: list[LoggerConfig] = Field(
        default_factory=list,
        max_length=8,
        description="Experiment trackers to log to (rank 0 only, never "
        "blocking a step): loss, learning rate, grad norm, throughput, eval metrics, checkpoints and restarts, "
        "with this config as hyperparameters.",
    )
    log_interval_steps: int = Field(default=10, ge=1, description="Steps between log lines and progress reports.")


#: `checkpoint.interval.steps: auto`'s bounds and prior when the spec leaves them out.
AUTO_MIN_STEPS = 10
AUTO_MAX_STEPS = 100_000
AUTO_PRIOR_SECONDS_BETWEEN_FAILURES = 3600
_AUTO_ONLY = ("minSteps", "maxSteps", "expectedSecondsBetweenFailures")


class CheckpointInterval(ApiModel):
    """When to checkpoint; whichever limit is reached first triggers a save."""

    model_config = ConfigDict(
        json_schema_extra=kubernetes_validations(
            [
                {
                    "rule": "has(self.steps) || has(self.seconds)",
                    "message": "set checkpoint.interval.steps, checkpoint.interval.seconds or both",
                },
                {
                    "rule": "(has(self.steps) && type(self.steps) == string) || "
                    + " && ".join(f"!has(self.{name})" for name in _AUTO_ONLY),
                    "message": "checkpoint.interval.minSteps, maxSteps and expectedSecondsBetweenFailures only apply "
                    "with steps: auto; remove them or set steps: auto",
                },
                {
                    "rule": "!has(self.minSteps) || !has(self.maxSteps) || self.minSteps <= self.maxSteps",
                    "message": "checkpoint.interval.minSteps is above maxSteps; make minSteps <= maxSteps",
                },
            ]
        )
    )

    steps: Optional[Union[Annotated[int, Field(ge=1)], Literal["auto"]]] = Field(
        default="auto",
        description="Save every this many optimizer steps, or `auto` (the default): the interval that loses the least "
        "training time, sqrt(2 x the measured cost of a save x the run's mean time between failures) (Young/Daly), "
        "within minSteps..maxSteps and never shorter than a commit. A failure is any restart of the training "
        "processes (crash, preemption, pod loss); until one is seen, expectedSecondsBetweenFailures stands in for the "
        "mean time between them. The first save comes after minSteps, to measure its cost. Persisting behind, a save "
        "costs training almost nothing (it commits in node memory), so auto checkpoints often and losing a worker "
        "costs few steps; storageInterval bounds what reaches storage. status.checkpointInterval shows the choice.",
    )
    seconds: Optional[int] = Field(
        default=None, ge=10, description="Save when this many seconds passed since the last save."
    )
    min_steps: Optional[int] = Field(
        default=None, ge=1, description=f"With steps: auto, the shortest interval (default {AUTO_MIN_STEPS})."
    )
    max_steps: Optional[int] = Field(
        default=None, ge=1, description=f"With steps: auto, the longest interval (default {AUTO_MAX_STEPS})."
    )
    expected_seconds_between_failures: Optional[int] = Field(
        default=None,
        ge=10,
        description="With steps: auto, the mean time between failures assumed until the first one (default "
        f"{AUTO_PRIOR_SECONDS_BETWEEN_FAILURES}, or the time run so far when longer); from then on, the seconds since "
        "the run started / the failures seen.",
    )

    @property
    def auto(self) -> bool:
        return self.steps == "auto"

    @field_validator("steps", mode="before")
    @classmethod
    def _steps(cls, value: Any) -> Any:
        if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError(f"{value!r} is neither a whole number of steps from 1 nor 'auto'; write e.g. 500 or auto")

    @model_validator(mode="after")
    def _consistent(self) -> "CheckpointInterval":
        if self.steps is None and self.seconds is None:
            raise ValueError(
                "neither steps nor seconds is set; set checkpoint.interval.steps, checkpoint.interval.seconds or both"
            )
        given = [
            name
            for name, field in (
                ("minSteps", self.min_steps),
                ("maxSteps", self.max_steps),
                ("expectedSecondsBetweenFailures", self.expected_seconds_between_failures),
            )
            if field is not None
        ]
        if given and not self.auto:
            raise ValueError(
                f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with steps: auto; "
                "remove it or set steps: auto"
            )
        if self.min_steps is not None and self.max_steps is not None and self.min_steps > self.max_steps:
            raise ValueError(f"minSteps {self.min_steps} is above maxSteps {self.max_steps}; make minSteps <= maxSteps")
        return self


class StorageInterval(ApiModel):
    """Persisting behind: how often a checkpoint committed in memory is also copied to storage."""

    model_config = ConfigDict(
        json_schema_extra=kubernetes_validations(
            [
                {
                    "rule": "has(self.steps) || has(self.seconds)",
                    "message": "set checkpoint.storageInterval.steps, checkpoint.storageInterval.seconds or both, or remove "
                    "storageInterval (then every checkpoint in memory is copied, at storage's pace)",
                }
            ]
        )
    )

    steps: Optional[int] = Field(
        default=None, ge=1, description="Copy a memory checkpoint when it is this many steps past the last one copied."
    )
    seconds: Optional[int] = Field(
        default=None,
        ge=1,
        description="Copy a memory checkpoint when this many seconds passed since the last copy began.",
    )

    @model_validator(mode="after")
    def _some_limit(self) -> "StorageInterval":
        if self.steps is None and self.seconds is None:
            raise ValueError(
                "neither steps nor seconds is set; set checkpoint.storageInterval.steps, .seconds or both, "
                "or remove storageInterval (then every checkpoint in memory is copied, at storage's pace)"
            )
        return self


class CheckpointConfig(ApiModel):
    """Where and how often the trainer checkpoints, and which checkpoints it keeps."""

    model_config = ConfigDict(
        json_schema_extra=kubernetes_validations(
            CHECKPOINT_URI_RULES
            + [
                {
                    "rule": "!has(self.endpointUrl) || self.uri.startsWith('s3://')",
                    "message": "endpointUrl is only used with s3:// URIs; remove it or use an s3:// uri",
                },
                {
                    "rule": f"!has(self.endpointUrl) || !self.endpointUrl.matches(r'{CREDENTIALS_IN_URI}')",
                    "message": f"checkpoint.endpointUrl {NO_CREDENTIALS}",
                },
                {
                    "rule": f"!has(self.resumeFrom) || !self.resumeFrom.matches(r'{CREDENTIALS_IN_URI}')",
                    "message": f"checkpoint.resumeFrom {NO_CREDENTIALS}",
                },
                {
                    "rule": f"!has(self.resumeFrom) || self.resumeFrom.matches(r'{RESUME_FROM_PATTERN}')",
                    "message": RESUME_FROM_SHAPE,
                },
                {
                    "rule": "!has(self.resumeFrom) || "
                    + " || ".join(
                        f"(self.uri.startsWith('{scheme}://') && self.resumeFrom.startsWith('{scheme}://'))"
                        for scheme in ("gs", "s3", "file")
                    ),
                    "message": SAME_STORAGE,
                },
            ]
        )
    )

    uri: str = Field(
        default=POD_DISK_CHECKPOINTS,
        max_length=1024,
        description="Base URI of this run's checkpoints: gs://bucket/path, s3://bucket/path or "
        "file:///path (a volume shared by all pods). The operator never deletes anything here. Default: the pod's "
        f"own disk ({POD_DISK_CHECKPOINTS}, which outlives in-place restarts of the workers but not the pod; "
        "one-pod runs only); under `trainingrun local`, ./runs/<name>/checkpoints.",
    )
    interval: CheckpointInterval = Field(
        default_factory=CheckpointInterval, description="How often to save (persisting behind: to commit in memory)."
    )
    storage_interval: Optional[StorageInterval] = Field(
        default=None,
        description="Persisting behind: how often a checkpoint committed in memory is also copied to storage, which "
        "is what a new pod resumes from (a restart of the workers inside the pod resumes from memory). Unset: every "
        "one, at storage's pace (while one is being copied, the newest waits and replaces any older one waiting). "
        "Set it to bound storage traffic (requests, egress) when checkpoints in memory come every few steps. SIGTERM "
        "and the end of the run copy the newest whatever the interval.",
    )
    keep: int = Field(default=3, ge=1, le=1000, description="Newest checkpoints to keep.")
    keep_every: Optional[int] = Field(
        default=None,
        ge=1,
        description="Also keep every checkpoint whose step is a multiple of this (milestones).",
    )
    async_save: bool = Field(
        default=True, description="Save in the background; training blocks only while state is staged."
    )
    memory_tier: bool = Field(
        default=True,
        description="Also keep the newest committed checkpoint in the pod's memory (/dev/shm, sized by "
        "resources.sharedMemory, counted in the pod's memory): a restart of the workers inside the pod loads it from "
        "there when it is the committed one, file by file verified against its manifest, instead of reading storage. "
        "Skipped, with one warning, while /dev/shm lacks room for it and a reserve.",
    )
    persist_behind: bool = Field(
        default=True,
        description="With memoryTier and every worker in one pod: a checkpoint commits once every worker's files are in "
        "the pod's memory, and rank 0 copies them to checkpoint.uri behind it, at storage's pace, newest first (a "
        "checkpoint made while an older one is still being copied replaces any waiting to be). Training never waits "
        "for storage, and a restart of the workers inside the pod resumes from the newest checkpoint in memory; a new "
        "pod resumes from the newest in storage, and SIGTERM and the end of the run wait until storage holds the last "
        "one. false, or several pods, or no room in /dev/shm: a checkpoint commits when storage holds it.",
    )
    writer_process: bool = Field(
        default=False,
        description="Write each rank's checkpoint files from a separate process at a low CPU priority instead of the "
        "trainer's checkpoint thread. Off by default, on GPUs too: on a 16-core H100 host the thread held the training "
        "steps beside a 1.8 GB save 0.09x a torch.save, the process 0.27x, and committed sooner (3.1 s against 4.2 s); "
        "an H200 measured the same order; a 2-core CPU run was 25% slower with it. Persisting behind, a checkpoint is "
        "staged straight into node memory and no writer process takes part. When on, state is staged into shared "
        "memory (/dev/shm, resources.sharedMemory) that every save reuses; saves before the writer has started, or "
        "while /dev/shm lacks room (one warning), are written in-process. A writer that dies fails only that save.",
    )
    resume_from: Optional[str] = Field(
        default=None,
        max_length=1024,
        description="Another run's checkpoint to start from when this run has none of its own: its step directory "
        "(<its checkpoint.uri>/step-NNNNNNNN; `trainingrun checkpoints URI` lists them), on the same storage as uri. "
        "Read only: it is verified and loaded (model, optimizer, schedule and step), never rotated or written. To "
        "fine-tune from a run, or to continue a run that was deleted and created again (a run never resumes from "
        "checkpoints another run wrote below its uri without it).",
    )
    endpoint_url: Optional[str] = Field(
        default=None,
        pattern=r"^https?://.+",
        max_length=1024,
        description="Endpoint of an S3-compatible store (MinIO, Ceph, R2); only for s3:// URIs.",
    )

    @field_validator("uri", mode="before")
    @classmethod
    def _uri(cls, value: Any) -> Any:
        problem = checkpoint_uri_problem(value) if isinstance(value, str) else None
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("endpoint_url", mode="before")
    @classmethod
    def _endpoint(cls, value: Any) -> Any:
        return refuse_credentials(value, NO_CREDENTIALS)

    @field_validator("resume_from", mode="before")
    @classmethod
    def _resume_from(cls, value: Any) -> Any:
        refuse_credentials(value, NO_CREDENTIALS)
        if isinstance(value, str) and not re.fullmatch(RESUME_FROM_PATTERN, value, re.ASCII):
            raise ValueError(RESUME_FROM_SHAPE.removeprefix("checkpoint.resumeFrom "))
        return value

    @model_validator(mode="after")
    def _resume_from_same_storage(self) -> "CheckpointConfig":
        if self.resume_from and self.resume_from.split("://")[0] != self.uri.split("://")[0]:
            raise ValueError(SAME_STORAGE)
        return self

    @model_validator(mode="after")
    def _endpoint_only_for_s3(self) -> "CheckpointConfig":
        if self.endpoint_url and not self.uri.startswith("s3://"):
            raise ValueError("endpointUrl is only used with s3:// URIs; remove it or use an s3:// uri")
        return self


class RunConfig(ApiModel):
    """The file mounted into every trainer container at TRAININGRUN_CONFIG."""

    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig


def config_json(config: RunConfig) -> str:
    """The trainer config as the operator and `trainingrun local` write it for the trainer (CONFIG_FILE_NAME)."""
    return json.dumps(config.to_wire(), indent=1) + "\n"


def load_config(path: str) -> RunConfig:
    """The trainer config at `path`: JSON when it ends in .json (what the operator writes), else YAML (a file of
    one's own, for a custom loop or a torchrun of one's own)."""
    as_json = path.endswith(".json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f) if as_json else yaml.safe_load(f)
    except OSError as error:
        raise ConfigError(f"cannot read the trainer config {path}: {error.strerror}") from None
    except (ValueError, yaml.YAMLError) as error:
        kind = "JSON" if as_json else "YAML"
        raise ConfigError(f"the trainer config {path} is not valid {kind}: {str(error)[:300]}") from None
    try:
        config: RunConfig = RunConfig.from_wire(data or {})
        return config
    except ValidationError as error:
        lines = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors(include_url=False)]
        raise ConfigError(f"invalid trainer config {path}:\n  " + "\n  ".join(lines)) from None
