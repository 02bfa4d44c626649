"""The Trainer's setup (trainer.py): the process group and device, the model with its precision, wrapping, compiling,
optimizer, schedule, EMA and health guard, and the data: datasets, the resumable sampler and the batches."""

from __future__ import annotations

import os
from typing import Any, Generator

import torch
from torch import nn
from torch.utils.data import DataLoader

from trainingrun_api import components

from . import efficiency
from .ema import WeightEMA
from .health import NonFiniteGuard
from .loading import batches_of, in_background, start_worker, worker_processes
from .optim import build_optimizer, build_scheduler
from .precision import PrecisionPlan
from .sampling import ResumableSampler, read_ahead
from .session import init_process_group
from .state import changed_by_forward


class TrainerSetup:
    """Part of `Trainer`: what a run builds before its first step."""

    def _init_distributed(self) -> None:
        self.distributed = self.context.world_size > 1
        if self.device_type == "cuda":
            torch.cuda.set_device(self.context.local_rank)
            self.device = torch.device("cuda", self.context.local_rank)
            tf32 = self.cfg.tf32 is not False
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
        else:
            self.device = torch.device("cpu")
        if self.distributed:
            init_process_group("nccl" if self.device_type == "cuda" else "gloo")

    def _build_model(self) -> None:
        model = components.build(self.cfg.model, "spec.trainer.model")
        self.plan = PrecisionPlan(self.cfg.precision, self.device_type)
        model = self.plan.prepare(model).to(self.device)
        if self.cfg.activation_checkpointing:
            from .torch_internals import checkpoint_wrapper

            blocks: Any = model.blocks  # a ModuleList (torch types a module's attributes as Tensor | Module)
            for i, block in enumerate(blocks):
                blocks[i] = checkpoint_wrapper(block)
        self.model = model  # the unwrapped module: what gets checkpointed and digested
        self.copy_before_forward = changed_by_forward(model)
        counts_tokens = getattr(model, "tokens_per_sample", None)
        self.tokens_per_sample = int(counts_tokens()) if callable(counts_tokens) else 0
        self.efficiency = efficiency.for_run(
            model,
            self.cfg.precision,
            self.device,
            self.context.world_size,
            self.cfg.flops_per_sample,
            self.cfg.peak_flops_per_second,
        )
        if self.cfg.strategy == "fsdp2" and self.distributed:
            from torch.distributed.fsdp import fully_shard

            blocks_to_shard: Any = model.blocks
            for block in blocks_to_shard:
                fully_shard(block)
            fully_shard(model)
            self.wrapped: Any = model  # DDP, FSDP2 or the model itself, maybe compiled
        elif self.distributed:
            self.wrapped = nn.parallel.DistributedDataParallel(
                model, device_ids=[self.device.index] if self.device_type == "cuda" else None
            )
        else:
            self.wrapped = model
        self.wrapped = efficiency.compiled(self.wrapped, self.cfg.compile, self.device_type)
        self.optimizer = build_optimizer(model, self.cfg.optimizer, self.device_type)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.schedule, self.cfg.max_steps)
        self.scaler = self.plan.grad_scaler()
        self.ema = WeightEMA(model, self.cfg.ema.decay) if self.cfg.ema.enabled else None
        self.guard = NonFiniteGuard(self.cfg.health)

    def _build_data(self) -> None:
        data = self.cfg.data
        self.dataset = components.build(data.dataset, "spec.trainer.data.dataset", split="train")
        #: Where DataLoader workers start from (None: no workers); a forkserver starts now (loading.worker_processes).
        self.workers_start = worker_processes(data.worker_start_method, self.dataset) if data.num_workers else None
        self.sampler = ResumableSampler(
            len(self.dataset),
            rank=self.context.rank,
            world_size=self.context.world_size,
            seed=self.cfg.seed,
            samples_per_step=data.batch_size * self.cfg.grad_accumulation_steps,
        )
        self.global_batch = data.batch_size * self.context.world_size
        ahead = getattr(self.dataset, "read_ahead", 0)  # datasets in object storage (shards.py) fetch ahead
        self.batch_order = (
            read_ahead(self.sampler, self.dataset.missing, ahead, self.dataset.fetch_threads) if ahead else None
        )
        if self.batch_order is not None:
            self.batch_order.begin()  # a cold cache's first fetches overlap the restore, not the first step
        self.eval_dataset = None
        if self.cfg.eval.interval_steps:
            evaluated, field, extra = components.evaluated_dataset(self.cfg)
            self.eval_dataset = components.build(evaluated, field, **extra)

    def _batches(self) -> Generator[dict[str, torch.Tensor], None, None]:
        """Endless batches from the sampler's current position; rebuilt after a resume or rollback."""
        data = self.cfg.data
        read_by_a_thread = data.num_workers == 0 and getattr(self.dataset, "pure_items", False)
        while True:
            generator = torch.Generator().manual_seed(self.cfg.seed + self.sampler.state_dict()["epoch"])
            loader = DataLoader(
                self.dataset,
                batch_size=data.batch_size,
                sampler=self.sampler if self.batch_order is None else self.batch_order,
                num_workers=data.num_workers,
                multiprocessing_context=self.workers_start,
                prefetch_factor=data.prefetch_factor,
                pin_memory=data.pin_memory and self.device_type == "cuda",
                worker_init_fn=start_worker(os.getpid()),
                generator=generator,
                drop_last=True,
            )
            produced = False
            for batch in in_background(loader) if read_by_a_thread else batches_of(loader, data.worker_start_method):
                produced = True
                yield {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            if not produced:
                raise RuntimeError(
                    "the dataset yields no full batch: spec.trainer.data.batchSize x world size is larger "
                    "than the dataset; lower batchSize or use more samples"
                )
