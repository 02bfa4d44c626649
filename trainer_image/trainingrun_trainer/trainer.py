"""The training loop: DDP or FSDP2 over torchrun, checkpoints, exact resume, preemption, health.

What makes resume exact: the data order is a pure function of (seed, epoch, samples consumed),
schedules are pure functions of the step, and the checkpoint holds model, optimizer, scheduler,
grad scaler, EMA, step, sampler position and every RNG state per rank (state.py). A resumed run therefore
computes the same steps an uninterrupted run would, and in deterministic mode the same bits.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from typing import Any, Callable, Generator, Optional

import numpy
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from trainingrun_api import exit_codes
from trainingrun_api.config import RunConfig

from . import metrics, model_contract, stragglers, tracking
from .checkpoint import CheckpointInfo, DigestOfEntry, model_digest
from .checkpoint_interval import SaveCosts
from .context import RunContext
from .health import Verdict
from .optim import scale_learning_rate, skips_on_device, step_unless
from .seeding import rng_state, seed_everything, set_rng_state, use_deterministic_algorithms
from .session import Run
from .state import CHANGED_BY_OPTIMIZER_STEP, ModelState, OptimizerState, PerRank, TrainState
from .step_values import LateValues, StepValues, found_inf, step_tensor
from .timekeeping import ProcessClock
from .trainer_setup import DataParts, ModelParts, build_data, build_model, config_hash, init_device
from .trainer_setup import batches as batches_of_run

log = logging.getLogger("trainingrun.trainer")

#: The most seconds between two progress reports the loop builds (half the reporter's interval when that is shorter).
REPORT_PACE_SECONDS = 1.0


class Trainer:
    """One process's training run: what it trains and reads (`parts` and `data`, built by trainer_setup.py as it
    starts), the loop, and what its checkpoints hold, saves and rollbacks."""

    session: Run  #: the platform's side of the run: checkpoints, resume, reports (session.py); set as training starts
    parts: ModelParts  #: the model and what trains it; built as the run starts
    data: DataParts  #: the data and the order it is read in; built as the run starts
    distributed: bool
    device: torch.device

    def __init__(self, config: RunConfig, context: RunContext, device_type: str):
        self.config = config
        self.context = context
        self.device_type = device_type
        self.cfg = config.trainer
        self.progress = TrainState(step=0, run_uid=context.uid)
        #: Step time that produced the current weights, summed over attempts (goodput's numerator).
        self.productive_seconds = 0.0
        self.samples_per_second: float | None = None  #: over the last logging window
        self.tokens_per_second: float | None = None  #: the same, for models that count tokens
        self.model_flops_per_second: float | None = None  #: the same, for models that count their FLOPs (`efficiency`)
        self.mfu: float | None = None  #: model FLOP/s over every rank's peak (GPUs the peak table knows)
        self.data_wait_seconds = 0.0  #: of the step in progress
        self.copy_wait_seconds = 0.0  #: of the step in progress: waiting for a checkpoint's background copy
        #: Steps' compute with and without a background save beside them: what a save slowed them by.
        self.save_slowdown = SaveCosts()
        self._beside_save = False  # a background save was written during the steps since the last one finished
        self.metrics: metrics.NullMetrics = metrics.NullMetrics()
        self.tracker: Any = tracking.NullTracker()
        self.tracked_checkpoint = 0  #: the newest committed step the trackers were told of
        self.resumed_step = 0  #: the step this process resumed at
        self.last_loss: float | None = None
        self.last_evaluation: tuple[int, float] | None = None  #: (step, eval loss) of the last evaluation
        #: The newest step whose values reached the host (a step late: `step_values`).
        self.last_values: Optional[StepValues] = None
        self._skips_on_device = False  #: the optimizer skips a non-finite step by a device flag (`optim.step_unless`)

    @property
    def step(self) -> int:
        return self.progress.step

    @step.setter
    def step(self, value: int) -> None:
        self.progress.step = value

    # ------------------------------------------------------------ checkpoints: state, saves, rollbacks

    def _state(self) -> dict[str, Any]:
        """Every component, as DCP Stateful entries: saved as they are now, loaded in place (state.py)."""
        state: dict[str, Any] = {
            "model": ModelState(self.parts.model),
            "optim": OptimizerState(self.parts.model, self.parts.optimizer),
            "scheduler": self.parts.scheduler,
            "scaler": self.parts.scaler,
            "sampler": self.data.sampler,
            "guard": self.parts.guard,
            "train": self.progress,
        }
        if self.parts.ema:
            state["ema"] = self.parts.ema
        return state

    def _first_forward(self, batch: Any) -> torch.Tensor:
        """This process's first forward, with the model's contract checked (model_contract): a model that returns
        something else than the loss, or whose forward has a bug, is named at once as a configuration error."""
        try:
            output = self.parts.wrapped(batch)
        except model_contract.CODE_ERRORS as error:
            raise model_contract.forward_failed(error, self.parts.model, batch) from error
        model_contract.check_loss(output, self.parts.model)
        return output

    def _per_rank(self) -> dict[str, Any]:
        return PerRank(
            rng=rng_state(),
            world_size=self.context.world_size,
            loss=self.last_loss,
            productive_seconds=self.productive_seconds,
        ).as_extra()

    def _apply_restored(self, extra: dict[str, Any]) -> None:
        """After a checkpoint was loaded into `_state()`'s entries: this rank's own values from its `extra`."""
        if self.distributed:
            # A rank that the checkpoint's world did not have (the job grew) has no values of its own; it takes
            # rank 0's (its RNG streams are reseeded below, as the world size changed).
            box = [extra if self.context.rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            extra = extra or box[0] or {}
        if "scheduler" in extra:
            self._apply_format_1(extra)
        mine = PerRank.from_extra(extra)
        # Work after this checkpoint is lost; only the time that produced this state still counts, and only
        # when this run produced it: goodput is over this run's wall time, so a TrainingRun created again on
        # an existing URI starts from zero (not from the earlier run's seconds).
        same_run = self.progress.run_uid == self.context.uid
        self.productive_seconds = mine.productive_seconds if same_run else 0.0
        self.progress.run_uid = self.context.uid
        self.last_loss = mine.loss
        if mine.world_size == self.context.world_size:
            set_rng_state(mine.rng)
        else:
            # Per-rank streams cannot be mapped to another world size; derive fresh, reproducible ones.
            seed_everything(self.cfg.seed + self.step, self.context.rank)

    def _apply_format_1(self, extra: dict[str, Any]) -> None:
        """A checkpoint saved before the state dict held every component (format 1): what every rank shares
        was in each rank's extra, and the store left those entries as they were."""
        self.progress.load_state_dict({"step": extra["step"], "run_uid": extra.get("run_uid", self.context.uid)})
        self.parts.scheduler.load_state_dict(extra["scheduler"])
        self.parts.scaler.load_state_dict(extra["scaler"])
        self.data.sampler.load_state_dict(extra["sampler"])
        self.parts.guard.load_state_dict(extra.get("guard", {}))

    def _account_step(self, started: float, kept: bool) -> float:
        """A step's time: data wait and compute in the process's clock, compute also productive when `kept`
        (rolled back steps are not). Returns the step's seconds."""
        seconds = time.monotonic() - started
        compute = max(0.0, seconds - self.data_wait_seconds - self.copy_wait_seconds)
        self.clock.add("data_wait", self.data_wait_seconds)
        self.clock.add("checkpoint", self.copy_wait_seconds)
        self.clock.add("compute", compute)
        self.clock.trained_samples += self.data.global_batch * self.cfg.grad_accumulation_steps
        if kept:
            self.productive_seconds += compute
            self._charge_save_slowdown(compute)
        return seconds

    def _charge_save_slowdown(self, compute: float) -> None:
        """Once a background save is done, the compute time it took from the steps beside it (their time beyond a
        usual step: the write competes for the CPU, memory bandwidth and the interpreter lock) is counted as
        "checkpoint", not productive: otherwise frequent saves look free while the run takes longer."""
        self.save_slowdown.step(compute, self._beside_save)
        if self._beside_save and not self.session.saving:
            self._beside_save = False
            slowdown = self.clock.recount(self.save_slowdown.save_finished(), "compute", "checkpoint")
            self.productive_seconds = max(0.0, self.productive_seconds - slowdown)

    def _final_commit(self) -> Optional[CheckpointInfo]:
        """The last step, in storage (persisting behind: once storage holds it), the same on every rank: saved, unless
        this process trained nothing (a finished run started again) and storage holds that step already."""
        if self.step == self.resumed_step:
            with self.clock.timing("checkpoint"):
                committed = self.session.flush()
            if committed is not None and committed.step == self.step:
                return committed
        self._save(blocking=True)
        with self.clock.timing("checkpoint"):
            return self.session.flush()

    def _save(self, blocking: bool) -> None:
        with self.clock.timing("checkpoint"):
            self._save_now(blocking)
        self._beside_save = self._beside_save or self.session.saving

    def _save_now(self, blocking: bool) -> None:
        state = self._state()
        if self.cfg.strategy == "fsdp2" and self.distributed:
            state["model"] = state["model"].state_dict()
            digest: Any = model_digest(state["model"])  # gathers full tensors: a collective, so here
        else:
            digest = DigestOfEntry("model")  # rank 0 computes it in the background
        self.session.save(
            self.step,
            state,
            self._per_rank(),
            model_digest=digest,
            blocking=blocking,
            copy_in_background=CHANGED_BY_OPTIMIZER_STEP,
        )

    def _wait_for_checkpoint_copy(self) -> None:
        """Before the weights change: wait until the save in flight has copied them (it copies in the background)."""
        self.copy_wait_seconds += self.session.wait_copied()

    def _track_commit(self) -> None:
        committed = self.session.last_committed
        if committed is not None and committed.step != self.tracked_checkpoint:
            self.tracked_checkpoint = committed.step
            self.tracker.metrics(self.step, {"checkpoint/committed_step": committed.step})

    def _rollback(self) -> bool:
        self.session.report_committed()
        rollbacks = self.parts.guard.rollbacks  # before the load, which restores the guard's count at that checkpoint
        newest = self.session.load_newest(self._state())
        if newest is None:
            log.error("non-finite steps and no checkpoint to roll back to: %s", self.parts.guard.abort_message())
            return False
        _, extra = newest
        self._apply_restored(extra)
        # The restored scheduler holds the LR scaled by the rollbacks made before that checkpoint
        # was saved (its guard state counts them); apply the scale of the ones made since.
        scaled_already = self.parts.guard.rollbacks
        self.parts.guard.rollbacks = rollbacks  # the count survives the restore, or we would loop forever
        scale_learning_rate(self.parts.scheduler, self.cfg.health.rollback_lr_scale ** (rollbacks - scaled_already))
        log.warning(
            "rolled back to step %d (%s); learning rate scaled by %s",
            self.step,
            self.parts.guard.last_reason,
            self.cfg.health.rollback_lr_scale,
        )
        return True

    # ------------------------------------------------------------ the loop

    def _train_step(
        self, batches: Generator[dict[str, torch.Tensor], None, None], loss_agreed: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, Callable[[], tuple]]:
        """Forward/backward over the accumulation, clip; returns (loss, grad norm, agreement), the loss and the norm
        on the device: nothing here waits for it (`step_values`).

        The per-step agreement between ranks (stop? save?) is started right after the last forward pass and
        completes during the backward pass, so it costs no extra round trip; `loss_agreed` (`Run.agrees_on_host`:
        the loss is in host memory) adds whether the step's loss is not finite to it. The gradient norm needs none:
        it is already global.
        """
        accumulation = self.cfg.grad_accumulation_steps
        if self.parts.copy_before_forward:
            self._wait_for_checkpoint_copy()
        self.parts.optimizer.zero_grad(set_to_none=True)
        self.compute_timer.start()  # this rank's own part, up to the agreement: stragglers.py
        total: Optional[torch.Tensor] = None
        agreement: Callable[[], tuple] = lambda: (False, False)  # noqa: E731 - replaced below
        for micro in range(accumulation):
            waited = time.perf_counter()
            batch = next(batches)
            self.data_wait_seconds += time.perf_counter() - waited
            last = micro == accumulation - 1
            sync = last or not isinstance(self.parts.wrapped, nn.parallel.DistributedDataParallel)
            # Gradients are all-reduced only on the last micro-batch of an accumulation.
            with self.parts.wrapped.no_sync() if not sync else contextlib.nullcontext():
                with self.parts.plan.autocast():
                    first = self.step == self.resumed_step and micro == 0
                    loss = (self._first_forward(batch) if first else self.parts.wrapped(batch)) / accumulation
                value = loss.detach().float()
                total = value if total is None else total + value
                if last:  # completes during the backward pass
                    # numpy: host memory here (`loss_agreed` only on CPUs), nothing that could wait on a device
                    loss_flag = (not numpy.isfinite(total.numpy()),) if loss_agreed else ()
                    own = self.compute_timer.stop()
                    agreement = self.session.agree_async(self.step + 1, *loss_flag, own_seconds=own)
                self.parts.scaler.scale(loss).backward()
        assert total is not None  # grad_accumulation_steps >= 1
        self.data.sampler.advance(self.data.global_batch * accumulation)
        self.parts.scaler.unscale_(self.parts.optimizer)
        clip = self.cfg.grad_clip_norm if self.cfg.grad_clip_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.parts.parameters, clip)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor of the norm's shards
            grad_norm = grad_norm.full_tensor()
        return total, grad_norm, agreement

    def _update(self, not_finite: torch.Tensor) -> float:
        """The optimizer step (and the EMA's) unless `not_finite` (`step_values.found_inf`) says the loss or the
        gradients were not finite on some rank; the rate it ran with. Decided on the device where the optimizer can
        be told by a tensor (fused, the default), so the host does not wait for the backward pass here."""
        parts = self.parts
        self._wait_for_checkpoint_copy()
        self.copy_wait_seconds += self.session.wait_for_commit()  # a lost pod then costs at most one interval
        skipped: Optional[torch.Tensor] = None  # for the EMA: None when the host knows the step was taken
        taken = True
        # Once an optimizer can be told by a device flag it stays so (SGD's momentum buffers, once made, are kept).
        self._skips_on_device = self._skips_on_device or skips_on_device(parts.optimizer)
        if parts.plan.precision == "16-mixed":
            parts.scaler.step(parts.optimizer)  # the scaler skips non-finite gradients itself (in the fused kernel)
            parts.scaler.update()  # and the EMA follows every scaler step, as it always has
        elif self._skips_on_device:
            step_unless(parts.optimizer, not_finite)
            skipped = not_finite
        else:  # an optimizer a device flag cannot skip (fused: false): one wait a step
            taken = not not_finite.item()
            if taken:
                parts.optimizer.step()
        if parts.ema and taken:
            parts.ema.update(parts.model, skipped)
        # The rate this step ran with: before the schedule moves on, and from the optimizer (a rollback lowers it
        # there; the scheduler's last rate is the one before that).
        return float(parts.optimizer.param_groups[0]["lr"])

    def _report_progress(self) -> None:
        """Where the run stands, to the reporter (which keeps the newest and sends it at its pace)."""
        self.session.report(
            self.step,
            total_steps=self.cfg.max_steps,
            loss=self.last_loss,
            samples_per_second=self.samples_per_second,
            productive_seconds=self.productive_seconds,
            process_time=self.clock,
            model_flops_per_second=self.model_flops_per_second,
            mfu=self.mfu,
            evaluation=self.last_evaluation,
        )

    def _observe(self, ready: list[StepValues]) -> Verdict:
        """The non-finite policy's verdict on the steps whose values reached the host (`LateValues`), in order; the
        first ROLLBACK or ABORT ends it (the steps after it are discarded with it). Their losses become the run's."""
        for values in ready:
            verdict = self.parts.guard.observe(values.step, values.loss_finite, values.grad_finite)
            if verdict is Verdict.ROLLBACK:
                self.metrics.nonfinite_step()
                self.metrics.rollback()
            if verdict in (Verdict.ROLLBACK, Verdict.ABORT):
                return verdict
            if verdict is Verdict.SKIP and self.parts.plan.precision != "16-mixed":  # fp16: the scaler's business
                self.metrics.nonfinite_step()
                log.warning("skipped step %d: %s", values.step, self.parts.guard.last_reason)
            self.last_loss, self.last_values = values.loss, values
            self.tracker.metrics(
                values.step,
                {
                    "train/loss": values.loss,
                    "train/learning_rate": values.learning_rate,
                    "train/grad_norm": values.grad_norm,
                    "train/samples_per_second": self.samples_per_second,
                    "train/tokens_per_second": self.tokens_per_second,
                    "train/model_flops_per_second": self.model_flops_per_second,
                    "train/mfu": self.mfu,
                },
            )
        return Verdict.OK

    def run(self) -> int:
        cfg = self.cfg
        self.clock = ProcessClock(self.context.pod_name)
        self.clock.mark("imports")
        seed_everything(cfg.seed, self.context.rank)
        use_deterministic_algorithms(cfg.deterministic)
        self.distributed, self.device = init_device(self.context, cfg, self.device_type)
        self.compute_timer = stragglers.ComputeTimer(self.device)
        self.metrics = metrics.for_rank(self.context, self.device_type)
        self.clock.mark("init")
        self.parts = build_model(cfg, self.context, self.device, self.device_type, self.distributed)
        self.clock.mark("model")
        self.data = build_data(cfg, self.context)
        self.clock.mark("data")
        try:
            return self._resume_and_train()
        finally:
            if self.data.batch_order is not None:
                self.data.batch_order.end_early_fetches()  # fetches begun for a first step that never came

    def _resume_and_train(self) -> int:
        cfg = self.cfg
        self.session = Run(self.context, self.config.checkpoint, config_hash=config_hash(self.config))
        with self.clock.timing("restore"):
            extra = self.session.resume(self._state())
            if extra is not None:
                self._apply_restored(extra)
        self.clock.restored_productive_seconds, self.resumed_step = self.productive_seconds, self.step
        if extra is not None:
            # Where the run stands now, before the first new step (which may be a while, or never).
            self.session.report(
                self.step,
                total_steps=self.cfg.max_steps,
                loss=self.last_loss,
                productive_seconds=self.productive_seconds,
            )
        self.tracker = tracking.for_rank(cfg.loggers, self.context)
        self.tracker.start(self.step, self.config.to_wire())
        self.tracker.metrics(
            self.step,
            {
                "run/attempt": self.context.attempt,
                "run/restarts_in_place": float(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0),
            },
        )
        batches = batches_of_run(self.data, self.cfg, self.device, self.device_type)
        self.clock.ready()
        code = None
        try:
            code = self._loop(batches)
        finally:
            batches.close()  # ends the DataLoader's workers, if any
            self.metrics.close()
            self.tracker.close(finished=code == exit_codes.OK)
        self._report_progress()  # the last word on this process's time: the final save included
        self.session.close(finished=code == exit_codes.OK)
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
        assert self.data.eval_dataset is not None
        cfg = self.cfg
        per_rank = cfg.data.batch_size
        world, rank = self.context.world_size, self.context.rank
        count = min(len(self.data.eval_dataset) // world, cfg.eval.batches * per_rank)
        indices = list(range(rank, count * world, world))
        loader = DataLoader(torch.utils.data.Subset(self.data.eval_dataset, indices), batch_size=per_rank)

        def mean_loss() -> float:
            total = torch.zeros(2, dtype=torch.float64, device=self.device)
            for batch in loader:
                batch = {k: v.to(self.device) for k, v in batch.items()}
                with self.parts.plan.autocast():
                    total[0] += float(self.parts.model(batch)) * len(next(iter(batch.values())))
                total[1] += len(next(iter(batch.values())))
            if self.distributed:
                dist.all_reduce(total)
            return float(total[0]) / max(float(total[1]), 1.0)

        results = {}
        with torch.random.fork_rng(devices=[self.device] if self.device_type == "cuda" else []):
            self.parts.model.eval()
            try:
                results["eval_loss"] = mean_loss()
                if self.parts.ema:
                    live = {name: p.detach().clone() for name, p in self.parts.model.named_parameters()}
                    self.parts.ema.copy_to(self.parts.model)
                    try:
                        results["eval_loss_ema"] = mean_loss()
                    finally:
                        for name, p in self.parts.model.named_parameters():
                            p.copy_(live[name])
            finally:
                self.parts.model.train()
        return results

    def _paused_seconds(self) -> float:
        """Seconds this process spent evaluating and checkpointing (blocked, waiting, or slowed by a background
        save), which samples/s, TFLOP/s and MFU leave out."""
        return self.clock.seconds["eval"] + self.clock.seconds["checkpoint"]

    def _loop(self, batches: Generator[dict[str, torch.Tensor], None, None]) -> int:
        cfg = self.cfg
        window_start, window_steps, window_paused = time.monotonic(), 0, self._paused_seconds()
        late = LateValues(self.device)
        on_host = self.session.agrees_on_host(self.device)
        reported_at, report_pace = -math.inf, min(REPORT_PACE_SECONDS, self.session.reporter.interval / 2)
        while self.step < cfg.max_steps:
            step_started = time.monotonic()
            self.data_wait_seconds = self.copy_wait_seconds = 0.0
            loss, grad_norm, agreement = self._train_step(batches, loss_agreed=on_host)
            # A NaN loss on one rank must skip or roll back every rank, or the replicas drift.
            values = step_tensor(loss, grad_norm, agree=not on_host)
            if on_host:  # the norm is the same on every rank (of gradients DDP or FSDP2 reduced): the loss's agreed
                stop, save_due, loss_not_finite = agreement()
                values[2] = float(loss_not_finite)
            else:
                stop, save_due = agreement()
            learning_rate = self._update(found_inf(values))
            self.parts.scheduler.step()
            self.step += 1
            late.put(self.step, learning_rate, values)
            window_steps += 1
            step_seconds = self._account_step(step_started, kept=True)
            logs = self.step % cfg.log_interval_steps == 0 or self.step == cfg.max_steps
            evaluates = bool(cfg.eval.interval_steps) and self.step % cfg.eval.interval_steps == 0
            # The host learns of a non-finite step a step late, except where it waits for every step's values
            # anyway: before a checkpoint holds the guard's counts, an evaluation, a log line.
            boundary = stop or save_due or logs or evaluates
            verdict = self._observe(late.drain() if boundary else late.ready())
            if verdict is Verdict.ROLLBACK:
                late.clear()
                if not self._rollback():
                    return exit_codes.DIVERGED
                batches.close()
                batches = batches_of_run(self.data, self.cfg, self.device, self.device_type)
                continue
            if verdict is Verdict.ABORT:
                log.error("%s", self.parts.guard.abort_message())
                return exit_codes.DIVERGED
            if not self.clock.first_step:
                log.info(self.clock.first_step_done(step_seconds))
                self.metrics.startup(self.clock)
                if not logs:  # its one-off cost (compiling, warming up) left out of samples/s: 20x lower with it
                    window_start, window_steps, window_paused = time.monotonic(), 0, self._paused_seconds()
            self.session.step_done(self.step)

            if evaluates:
                with self.clock.timing("eval"):
                    results = self._evaluate()
                log.info("eval step %d %s", self.step, " ".join(f"{k} {v:.4f}" for k, v in results.items()))
                self.metrics.evaluation(self.step, results)
                self.last_evaluation = (self.step, results["eval_loss"])
                self.tracker.metrics(
                    self.step, {f"eval/{name.removeprefix('eval_')}": value for name, value in results.items()}
                )

            newest = self.last_values
            self.metrics.step(
                step=self.step,
                loss=newest.loss if newest else math.nan,
                learning_rate=learning_rate,
                grad_norm=newest.grad_norm if newest else math.nan,
                step_seconds=step_seconds,
                data_wait_seconds=self.data_wait_seconds,
                productive_seconds=self.productive_seconds,
                samples_per_second=self.samples_per_second,
                tokens_per_second=self.tokens_per_second,
                model_flops_per_second=self.model_flops_per_second,
                mfu=self.mfu,
            )
            self.metrics.checkpoints(self.session.store, self.session.checkpoint_wait_seconds)
            self._track_commit()
            # The reporter keeps only the newest and sends at its own pace: a report is built at about that pace
            # (and at each log line), not every step.
            if logs or step_started - reported_at >= report_pace:
                reported_at = step_started
                self._report_progress()
            if logs and newest is not None:
                self.metrics.checkpoint_interval(self.session.interval_choice())
                self.metrics.spread(self.compute_timer.latest, self.session.step_spread())
                # Training time only: evaluation and checkpoints in the window are not throughput.
                elapsed = time.monotonic() - window_start - (self._paused_seconds() - window_paused)
                self.samples_per_second = (
                    window_steps * self.data.global_batch * cfg.grad_accumulation_steps / max(elapsed, 1e-9)
                )
                if self.parts.tokens_per_sample:
                    self.tokens_per_second = self.samples_per_second * self.parts.tokens_per_sample
                self.model_flops_per_second = self.parts.efficiency.flops_per_second(self.samples_per_second)
                self.mfu = self.parts.efficiency.mfu(self.samples_per_second)
                log.info(
                    "step %d/%d loss %.4f grad_norm %.3f lr %.3g samples/s %.1f%s",
                    self.step,
                    cfg.max_steps,
                    newest.loss,
                    newest.grad_norm,
                    learning_rate,
                    self.samples_per_second,
                    (f" TFLOP/s {self.model_flops_per_second / 1e12:.3g}" if self.model_flops_per_second else "")
                    + (f" MFU {self.mfu:.1%}" if self.mfu is not None else ""),
                )
                window_start, window_steps, window_paused = time.monotonic(), 0, self._paused_seconds()

            if stop:
                log.warning("SIGTERM: writing an emergency checkpoint at step %d", self.step)
                self._save(blocking=True)
                return exit_codes.PREEMPTED
            if save_due and self.step < cfg.max_steps:
                self._save(blocking=False)
        committed = self._final_commit()
        if committed is None or committed.step != self.step:
            # Exiting 0 would report success with the final weights lost; a retry redoes the steps
            # after the last good checkpoint and saves again (or, inside the pod, finds them in memory).
            log.error(
                "the final checkpoint at step %d is not in storage; exiting with the retryable code %d",
                self.step,
                exit_codes.RETRYABLE,
            )
            return exit_codes.RETRYABLE
        self.session.report_committed()
        self._track_commit()
        return exit_codes.OK
