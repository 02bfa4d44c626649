"""The training loop: DDP or FSDP2 over torchrun, checkpoints, exact resume, preemption, health.

What makes resume exact: the data order is a pure function of (seed, epoch, samples consumed),
schedules are pure functions of the step, and the checkpoint holds model, optimizer, scheduler,
grad scaler, EMA, step, sampler position and every RNG state per rank. A resumed run therefore
computes the same steps an uninterrupted run would, and in deterministic mode the same bits.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import math
import signal
import time
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from . import components, exit_codes
from .checkpoint import CheckpointStore, model_digest
from .config import RunConfig
from .context import RunContext
from .data import ResumableSampler, seed_worker
from .ema import WeightEMA
from .health import NonFiniteGuard, Verdict
from .optim import build_optimizer, build_scheduler, scale_learning_rate
from .precision import PrecisionPlan
from .reporting import ApiEndpoint, StatusReporter
from .seeding import rng_state, seed_everything, set_rng_state, use_deterministic_algorithms

log = logging.getLogger("trainingrun.trainer")


def rfc3339_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def config_hash(config: RunConfig) -> str:
    """Identifies the training recipe; the checkpoint URI is left out so a run can move buckets."""
    recipe = config.trainer.to_wire()
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


class Trainer:
    def __init__(self, config: RunConfig, context: RunContext, device_type: str):
        self.config = config
        self.context = context
        self.device_type = device_type
        self.cfg = config.trainer
        self.stop_requested = False
        self.step = 0
        #: Step time that produced the current weights, summed over attempts (goodput's numerator).
        self.productive_seconds = 0.0

    # ------------------------------------------------------------ setup

    def _init_distributed(self) -> None:
        self.distributed = self.context.world_size > 1
        if self.device_type == "cuda":
            torch.cuda.set_device(self.context.local_rank)
            self.device = torch.device("cuda", self.context.local_rank)
        else:
            self.device = torch.device("cpu")
        if self.distributed and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device_type == "cuda" else "gloo")

    def _build_model(self) -> None:
        model = components.build(self.cfg.model, "spec.trainer.model")
        self.plan = PrecisionPlan(self.cfg.precision, self.device_type)
        model = self.plan.prepare(model).to(self.device)
        if self.cfg.activation_checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            blocks = model.blocks
            for i, block in enumerate(blocks):
                blocks[i] = checkpoint_wrapper(block)
        self.model = model  # the unwrapped module: what gets checkpointed and digested
        if self.cfg.strategy == "fsdp2" and self.distributed:
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            self.wrapped: nn.Module = model
        elif self.distributed:
            self.wrapped = nn.parallel.DistributedDataParallel(
                model, device_ids=[self.device.index] if self.device_type == "cuda" else None
            )
        else:
            self.wrapped = model
        if self.cfg.compile:
            self.wrapped = torch.compile(self.wrapped)
        self.optimizer = build_optimizer(model, self.cfg.optimizer)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.schedule, self.cfg.max_steps)
        self.scaler = self.plan.grad_scaler()
        self.ema = WeightEMA(model, self.cfg.ema.decay) if self.cfg.ema.enabled else None
        self.guard = NonFiniteGuard(self.cfg.health)

    def _build_data(self) -> None:
        data = self.cfg.data
        self.dataset = components.build(data.dataset, "spec.trainer.data.dataset", split="train")
        self.sampler = ResumableSampler(
            len(self.dataset),
            rank=self.context.rank,
            world_size=self.context.world_size,
            seed=self.cfg.seed,
            samples_per_step=data.batch_size * self.cfg.grad_accumulation_steps,
        )
        self.global_batch = data.batch_size * self.context.world_size
        self.eval_dataset = None
        if self.cfg.eval.interval_steps:
            self.eval_dataset = components.build(data.dataset, "spec.trainer.data.dataset", split="eval")

    def _batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """Endless batches from the sampler's current position; rebuilt after a resume or rollback."""
        while True:
            generator = torch.Generator().manual_seed(self.cfg.seed + self.sampler.state_dict()["epoch"])
            loader = DataLoader(
                self.dataset,
                batch_size=self.cfg.data.batch_size,
                sampler=self.sampler,
                num_workers=self.cfg.data.num_workers,
                worker_init_fn=seed_worker,
                generator=generator,
                drop_last=True,
            )
            produced = False
            for batch in loader:
                produced = True
                yield {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            if not produced:
                raise RuntimeError(
                    "the dataset yields no full batch: spec.trainer.data.batchSize x world size is larger "
                    "than the dataset; lower batchSize or use more samples"
                )

    # ------------------------------------------------------------ checkpoint state

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state}
        if self.ema:
            state["ema"] = self.ema.state_dict()
        return state

    def _extra(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "productive_seconds": self.productive_seconds,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "guard": self.guard.state_dict(),
            "rng": rng_state(),
            "world_size": self.context.world_size,
        }

    def _restore(self, source: Any) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        extra = self.store.load(source, state)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if self.ema:
            self.ema.load_state_dict(state["ema"])
        self.step = int(extra["step"])
        # Work after this checkpoint is lost; only the time that produced this state still counts.
        self.productive_seconds = float(extra.get("productive_seconds", 0.0))
        self.scheduler.load_state_dict(extra["scheduler"])
        self.scaler.load_state_dict(extra["scaler"])
        self.sampler.load_state_dict(extra["sampler"])
        self.guard.load_state_dict(extra.get("guard", {}))
        if extra.get("world_size") == self.context.world_size:
            set_rng_state(extra["rng"])
        else:
            # Per-rank streams cannot be mapped to another world size; derive fresh, reproducible ones.
            seed_everything(self.cfg.seed + self.step, self.context.rank)

    def _report_committed(self) -> None:
        """Finish the in-flight save (the next save would wait for it anyway) and report it."""
        info = self.store.wait()
        if info is not None and self.context.is_rank_zero:
            self.reporter.report(lastGoodCheckpoint={"uri": info.uri, "step": info.step, "time": info.time,
                                                     "sha256": info.manifest_sha256})

    def _save(self, blocking: bool) -> None:
        self._report_committed()
        self.store.save(
            self.step,
            self._state(),
            self._extra(),
            config_hash=self.config_hash,
            model_digest=model_digest(self._state()["model"]),
            blocking=blocking,
        )
        self.last_save_time = time.monotonic()

    # ------------------------------------------------------------ the loop

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.stop_requested = True

    def _agree(self, stop: bool, save_due: bool) -> tuple[bool, bool]:
        """All ranks act together: a stop or a save on one rank is a stop or save on all."""
        if not self.distributed:
            return stop, save_due
        flags = torch.tensor([float(stop), float(save_due)], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])

    def _train_step(self, batches: Iterator[dict[str, torch.Tensor]]) -> tuple[float, float]:
        accumulation = self.cfg.grad_accumulation_steps
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(accumulation):
            batch = next(batches)
            last = micro == accumulation - 1
            sync = last or not isinstance(self.wrapped, nn.parallel.DistributedDataParallel)
            # Gradients are all-reduced only on the last micro-batch of an accumulation.
            with self.wrapped.no_sync() if not sync else contextlib.nullcontext():
                with self.plan.autocast():
                    loss = self.wrapped(batch) / accumulation
                self.scaler.scale(loss).backward()
            total += float(loss.detach())
        self.sampler.advance(self.global_batch * accumulation)
        self.scaler.unscale_(self.optimizer)
        clip = self.cfg.grad_clip_norm if self.cfg.grad_clip_norm is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        return total, grad_norm

    def run(self) -> int:
        cfg = self.cfg
        seed_everything(cfg.seed, self.context.rank)
        use_deterministic_algorithms(cfg.deterministic)
        self._init_distributed()
        self._build_model()
        self._build_data()
        self.config_hash = config_hash(self.config)
        ckpt = self.config.checkpoint
        self.store = CheckpointStore(ckpt.uri, keep=ckpt.keep, keep_every=ckpt.keep_every, endpoint_url=ckpt.endpoint_url)
        endpoint = ApiEndpoint.in_cluster() if self.context.is_rank_zero else None
        self.reporter = StatusReporter(endpoint, self.context.namespace, self.context.name)
        signal.signal(signal.SIGTERM, self._on_sigterm)

        source = self.context.resume_from or self.store.latest_valid()
        if source is not None:
            self._restore(source)
            log.info("resumed from %s at step %d", getattr(source, "uri", source), self.step)
        self.last_save_time = time.monotonic()
        batches = self._batches()
        code = self._loop(batches)
        self._report_committed()
        self.reporter.close()
        if self.distributed:
            dist.destroy_process_group()
        return code

    @torch.no_grad()
    def _evaluate(self) -> dict[str, float]:
        """Mean loss on the held-out split (and with EMA weights when enabled), over all ranks.

        Each rank reads its own slice of the first `batches` global batches, so the figure does not
        depend on the world size more than rounding. RNG is forked so evaluation never changes
        the training stream: a resumed run and an uninterrupted one stay identical.
        """
        assert self.eval_dataset is not None
        cfg = self.cfg
        per_rank = cfg.data.batch_size
        world, rank = self.context.world_size, self.context.rank
        count = min(len(self.eval_dataset) // world, cfg.eval.batches * per_rank)
        indices = list(range(rank, count * world, world))
        loader = DataLoader(torch.utils.data.Subset(self.eval_dataset, indices), batch_size=per_rank)

        def mean_loss() -> float:
            total = torch.zeros(2, dtype=torch.float64, device=self.device)
            for batch in loader:
                batch = {k: v.to(self.device) for k, v in batch.items()}
                with self.plan.autocast():
                    total[0] += float(self.model(batch)) * len(next(iter(batch.values())))
                total[1] += len(next(iter(batch.values())))
            if self.distributed:
                dist.all_reduce(total)
            return float(total[0] / max(total[1], 1))

        results = {}
        with torch.random.fork_rng(devices=[self.device] if self.device_type == "cuda" else []):
            self.model.eval()
            try:
                results["eval_loss"] = mean_loss()
                if self.ema:
                    live = {name: p.detach().clone() for name, p in self.model.named_parameters()}
                    self.ema.copy_to(self.model)
                    try:
                        results["eval_loss_ema"] = mean_loss()
                    finally:
                        for name, p in self.model.named_parameters():
                            p.copy_(live[name])
            finally:
                self.model.train()
        return results

    def _loop(self, batches: Iterator[dict[str, torch.Tensor]]) -> int:
        cfg, ckpt = self.cfg, self.config.checkpoint
        window_start, window_steps = time.monotonic(), 0
        while self.step < cfg.max_steps:
            step_started = time.monotonic()
            loss, grad_norm = self._train_step(batches)
            verdict = self.guard.observe(self.step + 1, math.isfinite(loss), math.isfinite(grad_norm))
            if verdict is Verdict.OK or (verdict is Verdict.SKIP and self.plan.precision == "16-mixed"):
                self.scaler.step(self.optimizer)  # with fp16 the scaler itself skips inf steps
                self.scaler.update()
                if self.ema:
                    self.ema.update(self.model)
            elif verdict is Verdict.ROLLBACK:
                if not self._rollback():
                    return exit_codes.DIVERGED
                batches = self._batches()
                continue
            elif verdict is Verdict.ABORT:
                log.error("%s", self.guard.abort_message())
                return exit_codes.DIVERGED
            else:
                log.warning("skipped step %d: %s", self.step + 1, self.guard.last_reason)
            self.scheduler.step()
            self.step += 1
            window_steps += 1
            self.productive_seconds += time.monotonic() - step_started

            if cfg.eval.interval_steps and self.step % cfg.eval.interval_steps == 0:
                results = self._evaluate()
                log.info("eval step %d %s", self.step, " ".join(f"{k} {v:.4f}" for k, v in results.items()))

            if self.step % cfg.log_interval_steps == 0 or self.step == cfg.max_steps:
                elapsed = time.monotonic() - window_start
                rate = window_steps * self.global_batch * cfg.grad_accumulation_steps / max(elapsed, 1e-9)
                log.info("step %d/%d loss %.4f grad_norm %.3f lr %.3g samples/s %.1f", self.step, cfg.max_steps,
                         loss, grad_norm, self.scheduler.get_last_lr()[0], rate)
                self.reporter.report(progress={"step": self.step, "totalSteps": cfg.max_steps,
                                               "loss": loss if math.isfinite(loss) else None,
                                               "samplesPerSecond": rate,
                                               "productiveSeconds": round(self.productive_seconds, 3),
                                               "updatedAt": rfc3339_now()})
                window_start, window_steps = time.monotonic(), 0

            interval = ckpt.interval
            save_due = (interval.steps is not None and self.step % interval.steps == 0) or (
                interval.seconds is not None and time.monotonic() - self.last_save_time >= interval.seconds
            )
            stop, save_due = self._agree(self.stop_requested, save_due)
            if stop:
                log.warning("SIGTERM: writing an emergency checkpoint at step %d", self.step)
                self._save(blocking=True)
                return exit_codes.PREEMPTED
            if save_due and self.step < cfg.max_steps:
                self._save(blocking=not ckpt.async_save)
        self._save(blocking=True)
        return exit_codes.OK

    def _rollback(self) -> bool:
        self.store.wait()
        info = self.store.latest_valid()
        if info is None:
            log.error("non-finite steps and no checkpoint to roll back to: %s", self.guard.abort_message())
            return False
        rollbacks = self.guard.rollbacks
        self._restore(info)
        self.guard.rollbacks = rollbacks  # the count survives the restore, or we would loop forever
        # The restored scheduler holds the LR from before any rollback; apply every rollback's scale.
        scale_learning_rate(self.scheduler, self.cfg.health.rollback_lr_scale**rollbacks)
        log.warning("rolled back to step %d (%s); learning rate scaled by %s", self.step, self.guard.last_reason,
                    self.cfg.health.rollback_lr_scale)
        return True

