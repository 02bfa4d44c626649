"""The Trainer's checkpoints (trainer.py): its state as DCP entries and each rank's own values, saves and what they
cost the steps beside them, restores and rollbacks after non-finite steps."""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch.distributed as dist

from .checkpoint import CheckpointInfo, DigestOfEntry, model_digest
from .optim import scale_learning_rate
from .seeding import rng_state, seed_everything, set_rng_state
from .state import CHANGED_BY_OPTIMIZER_STEP, ModelState, OptimizerState, PerRank

log = logging.getLogger("trainingrun.trainer")


class TrainerCheckpoints:
    """Part of `Trainer`: what a checkpoint holds of it, and saving, restoring and rolling back."""

    def _state(self) -> dict[str, Any]:
        """Every component, as DCP Stateful entries: saved as they are now, loaded in place (state.py)."""
        state: dict[str, Any] = {
            "model": ModelState(self.model),
            "optim": OptimizerState(self.model, self.optimizer),
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "sampler": self.sampler,
            "guard": self.guard,
            "train": self.progress,
        }
        if self.ema:
            state["ema"] = self.ema
        return state

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
        self.scheduler.load_state_dict(extra["scheduler"])
        self.scaler.load_state_dict(extra["scaler"])
        self.sampler.load_state_dict(extra["sampler"])
        self.guard.load_state_dict(extra.get("guard", {}))

    def _account_step(self, started: float, kept: bool) -> float:
        """A step's time: data wait and compute in the process's clock, compute also productive when `kept`
        (rolled back steps are not). Returns the step's seconds."""
        seconds = time.monotonic() - started
        compute = max(0.0, seconds - self.data_wait_seconds - self.copy_wait_seconds)
        self.clock.add("data_wait", self.data_wait_seconds)
        self.clock.add("checkpoint", self.copy_wait_seconds)
        self.clock.add("compute", compute)
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
                committed = self.session.store.flush()
            if committed is not None and committed.step == self.step:
                return committed
        self._save(blocking=True)
        with self.clock.timing("checkpoint"):
            return self.session.store.flush()

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
        self.copy_wait_seconds += self.session.store.wait_copied()

    def _track_commit(self) -> None:
        committed = self.session.last_committed
        if committed is not None and committed.step != self.tracked_checkpoint:
            self.tracked_checkpoint = committed.step
            self.tracker.metrics(self.step, {"checkpoint/committed_step": committed.step})

    def _rollback(self) -> bool:
        self.session.report_committed()
        info = self.session.store.latest_valid()
        if info is None:
            log.error("non-finite steps and no checkpoint to roll back to: %s", self.guard.abort_message())
            return False
        rollbacks = self.guard.rollbacks
        self._apply_restored(self.session.store.load(info, self._state()))
        # The restored scheduler holds the LR scaled by the rollbacks made before that checkpoint
        # was saved (its guard state counts them); apply the scale of the ones made since.
        scaled_already = self.guard.rollbacks
        self.guard.rollbacks = rollbacks  # the count survives the restore, or we would loop forever
        scale_learning_rate(self.scheduler, self.cfg.health.rollback_lr_scale ** (rollbacks - scaled_already))
        log.warning(
            "rolled back to step %d (%s); learning rate scaled by %s",
            self.step,
            self.guard.last_reason,
            self.cfg.health.rollback_lr_scale,
        )
        return True
