"""The trainer's configuration: the `spec.trainer` section of a TrainingRun (`spec.checkpoint` is `checkpoint_config`'s).

This module imports no torch on purpose: the operator and `trainingrun validate` use these models
to check a TrainingRun before any pod or process exists. The mounted config file that a trainer pod
reads (`TRAININGRUN_CONFIG`) is a `RunConfig`: the same two sections, in the same camelCase shape
as in the TrainingRun, so a user can copy between them.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal, Optional

import orjson
import yaml
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from . import nesting
from .checkpoint_config import CheckpointConfig
from .logger_config import LoggerConfig
from .model_base import (
    ApiModel,
    ConfigError,
    kubernetes_validations,
)

Precision = Literal["32-true", "16-mixed", "bf16-mixed", "bf16-true"]
ScheduleName = Literal["cosine", "cosine-warm-restarts", "inverse-sqrt", "exponential", "step", "constant"]
OptimizerName = Literal["adamw", "sgd"]
Strategy = Literal["ddp", "fsdp2"]

PYTHON_PATH_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$"

#: Limits of a free-form field (`initArgs`): the API server stores any nesting its JSON decoder takes, and every reader
#: after it (pydantic, JSON writers, the pods' annotations of at most 256 KiB) has a smaller limit. The CRD checks the
#: keys (maxProperties); depth and size are checked here, by `trainingrun validate` and by the operator.
FREE_FORM_MAX_DEPTH = 16
FREE_FORM_MAX_BYTES = 64 << 10
FREE_FORM_MAX_KEYS = 256


def free_form_problem(value: Any) -> Optional[str]:
    """What is wrong with a free-form value's size, or None (the value itself at level 1)."""
    if nesting.deeper_than(value, FREE_FORM_MAX_DEPTH) is not None:
        return f"nests deeper than {FREE_FORM_MAX_DEPTH} levels; flatten it, or pass a file the class reads"
    try:
        size = len(orjson.dumps(value))
    except (TypeError, ValueError):
        return None  # not JSON (a YAML date, a set): the field's own type check says so
    if size > FREE_FORM_MAX_BYTES:
        return f"is {size} bytes as JSON, more than {FREE_FORM_MAX_BYTES}; pass a file the class reads"
    return None


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
        description="Keyword arguments passed to the class's constructor: free-form, at most "
        f"{FREE_FORM_MAX_KEYS} keys, nested at most {FREE_FORM_MAX_DEPTH} levels and {FREE_FORM_MAX_BYTES // 1024} KiB "
        "as JSON (large settings belong in a file the class reads).",
        json_schema_extra={"maxProperties": FREE_FORM_MAX_KEYS},
    )

    @field_validator("class_path", mode="before")
    @classmethod
    def _dotted_path(cls, value: Any) -> Any:
        if isinstance(value, str) and not re.fullmatch(PYTHON_PATH_PATTERN, value, re.ASCII):
            raise ValueError(f"'{value}' is not a dotted Python path; write it as package.module.ClassName")
        return value

    @field_validator("init_args", mode="before")
    @classmethod
    def _bounded(cls, value: Any) -> Any:
        # Before anything else reads it: pydantic and every JSON writer recurse once per level.
        problem = free_form_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("init_args")
    @classmethod
    def _finite_numbers(cls, value: dict[str, Any]) -> dict[str, Any]:
        # YAML has .nan and .inf (`trainingrun local` reads YAML), JSON and so the cluster's API have neither, and
        # the config written for the trainer is JSON.
        pending: list[Any] = [value]
        while pending:
            item = pending.pop()
            if isinstance(item, float) and not math.isfinite(item):
                raise ValueError(f"{item} is not a finite number (JSON, which the cluster uses, has none); write one")
            if isinstance(item, dict):
                pending.extend(item.values())
            elif isinstance(item, list):
                pending.extend(item)
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
        "made on the training thread, between steps (on a GPU while the steps queued before compute). With heavy "
        "decoding or augmentation, 2-4 keep up with a GPU (watch trainingrun_data_wait_seconds).",
    )
    worker_start_method: Literal["forkserver", "spawn", "fork"] = Field(
        default="forkserver",
        description="How DataLoader workers start (numWorkers > 0). forkserver: from a clean process that has "
        "imported torch and the dataset's module, so a worker starts in milliseconds and inherits no lock held by the "
        "trainer's background threads (checkpoint, read-ahead); the dataset must be picklable. fork: copies the "
        "training process, for datasets that cannot be pickled; a worker forked while another thread holds a lock "
        "(e.g. torch's thread pool) can hang at its start. spawn: a fresh interpreter per worker, slowest to start.",
    )
    prefetch_factor: Optional[int] = Field(
        default=None,
        ge=1,
        le=64,
        description="Batches each worker loads ahead (PyTorch's default 2); needs numWorkers > 0.",
    )
    pin_memory: bool = Field(
        default=True,
        description="Batches in page-locked host memory, copied to the GPU a batch ahead on a stream of their own, "
        "so the copy overlaps the step before (CUDA only; ignored on CPU). false: each batch is copied by the step "
        "that uses it, from pageable memory, which waits on the host for the copy.",
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
        description="The optimizer's fused kernel (one kernel per step for all parameters, AdamW or SGD, GPUs and "
        "CPUs). Unset: on. It also skips a step with non-finite gradients in the kernel, so the host never waits "
        "for the GPU inside a step; false waits once a step for that. Results differ from the unfused optimizer in "
        "the last bits; a run resumes exactly either way.",
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
    """Periodic evaluation: on the training dataset's held-out split, or on a dataset of its own."""

    model_config = ConfigDict(
        json_schema_extra=kubernetes_validations(
            [
                {
                    "rule": "!has(self.dataset) || (has(self.intervalSteps) && self.intervalSteps > 0)",
                    "message": "dataset is set but intervalSteps is 0, so nothing would evaluate on it: set "
                    "intervalSteps (e.g. 100), or remove dataset",
                }
            ]
        )
    )

    interval_steps: int = Field(default=0, ge=0, description="Evaluate every this many steps; 0 turns evaluation off.")
    batches: int = Field(default=10, ge=1, le=100000, description="Batches per evaluation.")
    dataset: Optional[Component] = Field(
        default=None,
        description="A dataset to evaluate on instead of data.dataset's held-out split (e.g. a validation file), "
        "as classPath and initArgs; built with `split: eval` added to initArgs. The built-in shard datasets read "
        "all of its files (evalFraction defaults to 1 here); set data.dataset's evalFraction to 0 to train on all "
        "of the training files. Needs intervalSteps > 0.",
    )

    @model_validator(mode="after")
    def _dataset_needs_an_interval(self) -> "EvalConfig":
        if self.dataset is not None and self.interval_steps == 0:
            raise ValueError(
                "dataset is set but intervalSteps is 0, so nothing would evaluate on it: set intervalSteps "
                "(e.g. 100), or remove dataset"
            )
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
        description="Wrap the model with torch.compile. Unset: on with GPUs, where a model that fails to compile "
        "trains uncompiled with a warning; off on CPUs. The first start of an attempt compiles (tens of seconds); a worker restarted in its pod finds the "
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
class RunConfig(ApiModel):
    """The file mounted into every trainer container at TRAININGRUN_CONFIG."""

    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig


def config_json(config: RunConfig) -> str:
    """The trainer config as the operator and `trainingrun local` write it for the trainer (CONFIG_FILE_NAME):
    compact, through orjson (3 us against json's 27 for the minimal run, 1% of the operator's CPU in a burst). Every
    number in it is finite (ApiModel refuses NaN and infinities), so orjson's and json's JSON mean the same."""
    return orjson.dumps(config.to_wire(), option=orjson.OPT_APPEND_NEWLINE).decode()


def load_config(path: str) -> RunConfig:
    """The trainer config at `path`: JSON when it ends in .json (what the operator writes), else YAML (a file of
    one's own, for a custom loop or a torchrun of one's own). A TrainingRun file works too: its `spec.trainer` and
    `spec.checkpoint` are the config (the rest of the spec is the cluster's, and is not read here)."""
    as_json = path.endswith(".json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f) if as_json else yaml.safe_load(f)
    except OSError as error:
        raise ConfigError(f"cannot read the trainer config {path}: {error.strerror}") from None
    except (ValueError, yaml.YAMLError) as error:
        kind = "JSON" if as_json else "YAML"
        raise ConfigError(f"the trainer config {path} is not valid {kind}: {str(error)[:300]}") from None
    if isinstance(data, dict) and data.get("kind") == "TrainingRun" and isinstance(data.get("spec"), dict):
        data = {key: data["spec"][key] for key in ("trainer", "checkpoint") if data["spec"].get(key) is not None}
    try:
        config: RunConfig = RunConfig.from_wire(data or {})
        return config
    except ValidationError as error:
        lines = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors(include_url=False)]
        raise ConfigError(f"invalid trainer config {path}:\n  " + "\n  ".join(lines)) from None
