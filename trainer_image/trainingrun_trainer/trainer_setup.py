"""What the Trainer (trainer.py) builds before its first step, as builder functions (spec in, objects out): the
device and process group (`init_device`), the model with its precision, wrapping, compiling, optimizer, schedule, EMA
and health guard (`build_model`), and the data: datasets, the resumable sampler (`build_data`) and the batches
(`batches`)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Generator, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

from trainingrun_api import components
from trainingrun_api.config import RunConfig, TrainerConfig

from . import chaos, efficiency, model_contract
from .context import RunContext
from .ema import WeightEMA
from .health import NonFiniteGuard
from .loading import ahead_on_device, batches_of, start_worker, worker_processes
from .optim import build_optimizer, build_scheduler
from .precision import PrecisionPlan
from .sampling import ResumableSampler, read_ahead
from .session import init_process_group
from .state import changed_by_forward


def init_device(context: RunContext, cfg: TrainerConfig, device_type: str) -> tuple[bool, torch.device]:
    """(whether the run is distributed, this rank's device); joins the process group when it is."""
    distributed = context.world_size > 1
    if device_type == "cuda":
        torch.cuda.set_device(context.local_rank)
        device = torch.device("cuda", context.local_rank)
        tf32 = cfg.tf32 is not False
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    else:
        device = torch.device("cpu")
    if distributed:
        init_process_group("nccl" if device_type == "cuda" else "gloo")
    return distributed, device


@dataclass
class ModelParts:
    """The model and what trains it."""

    #: The unwrapped module: what gets checkpointed and digested.
    model: nn.Module
    #: Its parameters, listed once: walking the module tree for them each step cost the tiny test model 0.09 ms.
    parameters: list[nn.Parameter]
    #: DDP, FSDP2 or the model itself, maybe compiled: what a step calls.
    wrapped: Any
    plan: PrecisionPlan
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    ema: Optional[WeightEMA]
    guard: NonFiniteGuard
    #: The forward pass changes the model's state (e.g. batch-norm statistics): a save's background copy must be
    #: done before it.
    copy_before_forward: bool
    #: Tokens in a sample, for models that count them (0: not counted).
    tokens_per_sample: int
    efficiency: efficiency.Efficiency


def build_model(
    cfg: TrainerConfig, context: RunContext, device: torch.device, device_type: str, distributed: bool
) -> ModelParts:
    model = components.build(cfg.model, "spec.trainer.model")
    plan = PrecisionPlan(cfg.precision, device_type)
    model = plan.prepare(model).to(device)
    if cfg.activation_checkpointing:
        from .torch_internals import checkpoint_wrapper

        blocks = model_contract.check_blocks(model, "spec.trainer.activationCheckpointing")
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block)
    counts_tokens = getattr(model, "tokens_per_sample", None)
    wrapped: Any = model
    if cfg.strategy == "fsdp2" and distributed:
        from torch.distributed.fsdp import fully_shard

        for block in model_contract.check_blocks(model, "spec.trainer.strategy fsdp2"):
            fully_shard(block)
        fully_shard(model)
    elif distributed:
        wrapped = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device_type == "cuda" else None
        )
    optimizer = build_optimizer(model, cfg.optimizer)
    return ModelParts(
        model=model,
        parameters=list(model.parameters()),
        wrapped=efficiency.compiled(wrapped, cfg.compile, device_type),
        plan=plan,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg.schedule, cfg.max_steps),
        scaler=plan.grad_scaler(),
        ema=WeightEMA(model, cfg.ema.decay) if cfg.ema.enabled else None,
        guard=NonFiniteGuard(cfg.health),
        copy_before_forward=changed_by_forward(model),
        tokens_per_sample=int(counts_tokens()) if callable(counts_tokens) else 0,
        efficiency=efficiency.for_run(
            model, cfg.precision, device, context.world_size, cfg.flops_per_sample, cfg.peak_flops_per_second
        ),
    )


@dataclass
class DataParts:
    """The run's data and the order it is read in."""

    dataset: Any
    sampler: ResumableSampler
    #: Where DataLoader workers start from (None: no workers); a forkserver starts as it is built.
    workers_start: Any
    #: Samples one step of every rank takes from the sampler, per micro-batch.
    global_batch: int
    #: The read-ahead of a dataset in object storage (None: it reads nothing ahead).
    batch_order: Any
    #: The held-out data evaluation reads (None: no evaluation).
    eval_dataset: Any


def build_data(cfg: TrainerConfig, context: RunContext) -> DataParts:
    data = cfg.data
    dataset = components.build(data.dataset, "spec.trainer.data.dataset", split="train")
    # Before the read-ahead's threads start: a worker may be forked from this process.
    workers_start = worker_processes(data.worker_start_method, dataset) if data.num_workers else None
    sampler = ResumableSampler(
        len(dataset),
        rank=context.rank,
        world_size=context.world_size,
        seed=cfg.seed,
        samples_per_step=data.batch_size * cfg.grad_accumulation_steps,
    )
    ahead = getattr(dataset, "read_ahead", 0)  # datasets in object storage (shards.py) fetch ahead
    batch_order = read_ahead(sampler, dataset.missing, ahead, dataset.fetch_threads) if ahead else None
    if batch_order is not None:
        batch_order.begin()  # a cold cache's first fetches overlap the restore, not the first step
    eval_dataset = None
    if cfg.eval.interval_steps:
        evaluated, field, extra = components.evaluated_dataset(cfg)
        eval_dataset = components.build(evaluated, field, **extra)
    return DataParts(
        dataset=dataset,
        sampler=sampler,
        workers_start=workers_start,
        global_batch=data.batch_size * context.world_size,
        batch_order=batch_order,
        eval_dataset=eval_dataset,
    )


def batches(
    parts: DataParts, cfg: TrainerConfig, device: torch.device, device_type: str
) -> Generator[dict[str, torch.Tensor], None, None]:
    """Endless batches from the sampler's current position; rebuilt after a resume or rollback."""
    data = cfg.data
    while True:
        generator = torch.Generator().manual_seed(cfg.seed + parts.sampler.state_dict()["epoch"])
        loader = DataLoader(
            parts.dataset,
            batch_size=data.batch_size,
            sampler=parts.sampler if parts.batch_order is None else parts.batch_order,
            num_workers=data.num_workers,
            multiprocessing_context=parts.workers_start,
            prefetch_factor=data.prefetch_factor,
            pin_memory=data.pin_memory and device_type == "cuda",
            worker_init_fn=start_worker(os.getpid()),
            generator=generator,
            drop_last=True,
        )
        produced = False
        # With numWorkers 0 on the training thread: a thread reading ahead took the interpreter lock from the step
        # as often as it saved it waiting (2-core VM: steps/s the same or 1-6% lower, 0.23 ms more host time a step).
        for batch in ahead_on_device(batches_of(loader, data.worker_start_method), device):
            produced = True
            chaos.data_gate()
            yield batch
        if not produced:
            raise RuntimeError(
                "the dataset yields no full batch: spec.trainer.data.batchSize x world size is larger "
                "than the dataset; lower batchSize or use more samples"
            )


def config_hash(config: RunConfig) -> str:
    """Identifies the training recipe; the checkpoint URI is left out so a run can move buckets, the loggers
    because where a run is tracked is not what it trains."""
    recipe = config.trainer.to_wire()
    recipe.pop("loggers", None)
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
