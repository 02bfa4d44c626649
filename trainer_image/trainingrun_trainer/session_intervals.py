"""When `Run` checkpoints (session.py): the intervals, fixed or chosen by `auto` from the measured costs of saves and
copies, the step time and the failures (checkpoint_interval.py), agreed by every rank."""

from __future__ import annotations

import logging
import time
from typing import Optional

from trainingrun_api.checkpoint_config import (
    AUTO_MAX_STEPS,
    AUTO_MIN_STEPS,
    AUTO_PRIOR_SECONDS_BETWEEN_FAILURES,
)
from trainingrun_api.progress_report import IntervalChoice

from .checkpoint_interval import AutoInterval

log = logging.getLogger("trainingrun.session")


class RunIntervals:
    """Part of `Run`: whether a step checkpoints, and the auto intervals' measurements and choices."""

    _step_began: Optional[float]

    def _auto_interval(self) -> Optional[AutoInterval]:
        """Rank 0's chooser of the intervals that are auto (checkpoint.interval.steps, and persisting behind
        checkpoint.storageInterval.steps); None when neither is."""
        interval, storage = self.checkpoint.interval, self.checkpoint.storage_interval
        storage_auto = storage is not None and storage.auto and self.store.persist_behind
        if not (interval.auto or storage_auto) or not self.context.is_rank_zero:
            return None
        # Until record_start reads the run's own count: the restarts this process can see for itself.
        return AutoInterval(
            interval.min_steps or AUTO_MIN_STEPS,
            interval.max_steps or AUTO_MAX_STEPS,
            interval.expected_seconds_between_failures or AUTO_PRIOR_SECONDS_BETWEEN_FAILURES,
            failures=self.context.attempt - 1 + self.context.restart_count,
            memory_auto=interval.auto,
            storage_auto=storage_auto,
            pod_losses=self.context.attempt - 1,
            max_steps_asked=interval.max_steps is not None,
        )

    def checkpoint_due(self, step: int) -> tuple[bool, bool]:
        """(stop, save): whether to stop for preemption and whether a periodic save is due.

        Collective under torch.distributed: every rank must call it at the same step, and all get
        the same answer, so a SIGTERM that reaches one rank first still stops all of them together.
        """
        stop, save = self.agree(step)
        return stop, save

    def _time_step(self, save_finished: bool) -> None:
        """The auto interval learns the step that ended now (from one agreement to the next), and what a save and a
        copy to storage cost; a storage interval that is auto takes its new choice."""
        chooser = self.auto_interval
        assert chooser is not None
        now = time.monotonic()
        copies = self.store.persists + self.store.failed_persists - self._copies_seen
        persisting = self.store.persisting
        beside_persist = chooser.storage_auto and (self._beside_persist or persisting or copies > 0)
        if self._step_began is not None:
            chooser.step(now - self._step_began, self._beside_save, beside_persist)
        self._step_began = now
        if self._beside_save and save_finished:
            chooser.save_finished(self.store.last_save_seconds)
        self._beside_save = not save_finished
        self._beside_persist = persisting
        if beside_persist and not persisting:
            self._copies_seen += copies
            chooser.persist_finished(copies, self.store.last_persist_seconds if self.store.persists else None)
            self._choose_storage_interval()

    def _choose_storage_interval(self) -> None:
        chooser = self.auto_interval
        assert chooser is not None
        self.store.persist_every_steps = chosen = chooser.storage_steps()
        if chosen == self._told_storage_steps:
            return
        self._told_storage_steps = chosen
        log.info(
            "storage interval (auto): %s; a copy to storage costs training %.3f s and takes %.2f s",
            f"every {chosen} steps" if chosen else "every checkpoint, at storage's pace",
            chooser.persist_cost or 0.0,
            chooser.persist_seconds or 0.0,
        )

    def interval_choice(self) -> Optional[IntervalChoice]:
        """With checkpoint.interval.steps: auto, on rank 0: the interval now and what it is made of."""
        return self.auto_interval.choice() if self.auto_interval is not None else None

    def _waited_for_the_save_before(self, step: int, seconds: float) -> None:
        self.checkpoint_wait_seconds += seconds
        if self._told_waiting:
            return
        self._told_waiting = True
        interval = self.checkpoint.interval
        every = (
            " and ".join(
                part
                for part in (
                    f"{interval.steps} steps" if isinstance(interval.steps, int) else "",
                    f"{interval.seconds:g} s" if interval.seconds is not None else "",
                )
                if part
            )
            or "its interval"
        )
        log.warning(
            "the checkpoint of step %d waited %.2f s for the one before it to commit: a commit takes %.2f s, "
            "longer than the interval (every %s), so checkpoints hold training back; make "
            "spec.checkpoint.interval longer (steps: auto chooses one shorter than a commit only to keep within the "
            "maxSteps you set: raise it). "
            "Counted in trainingrun_checkpoint_wait_seconds_total; said once",
            step,
            seconds,
            self.store.last_save_seconds,
            every,
        )
