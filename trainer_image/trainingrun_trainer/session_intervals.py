"""`IntervalPolicy`: when `Run` (session.py) checkpoints. The intervals are fixed, or chosen by `auto` from the
measured costs of saves and copies to storage, the step time and the failures (`checkpoint_interval.AutoInterval`);
rank 0 decides and `Run.agree` makes every rank save with it."""

from __future__ import annotations

import logging
import time
from typing import Optional

from trainingrun_api.checkpoint_config import (
    AUTO_MAX_STEPS,
    AUTO_MIN_STEPS,
    AUTO_PRIOR_SECONDS_BETWEEN_FAILURES,
    CheckpointConfig,
)
from trainingrun_api.progress_report import IntervalChoice

from .checkpoint import CheckpointStore
from .checkpoint_interval import AutoInterval
from .context import RunContext

log = logging.getLogger("trainingrun.session")


class IntervalPolicy:
    """Whether a step checkpoints (`due`), fed what the steps and the store measure; the storage interval, when it is
    auto, set on the store's persister as it is chosen."""

    def __init__(self, checkpoint: CheckpointConfig, store: CheckpointStore, context: RunContext):
        self._checkpoint = checkpoint
        self._store = store
        #: Rank 0's chooser of the intervals that are auto (None when neither is, and on the other ranks).
        self.auto = self._auto_interval(context)
        self._last_save = time.monotonic()
        self._last_saved_step = 0
        self._step_began: Optional[float] = None  # when the current step's agreement was asked for
        self._beside_save = False  # a save was staged or written during the current step
        self._beside_persist = False  # a copy to storage ran during the current step (storageInterval auto)
        self._copies_seen = 0  # the store's copies to storage (done or failed) measured so far
        self._told_storage_steps: Optional[int] = None
        #: Seconds saves waited for the save before them to commit: an interval shorter than a commit holds training
        #: back (trainingrun_checkpoint_wait_seconds_total).
        self.wait_seconds = 0.0
        self._told_waiting = False

    def _auto_interval(self, context: RunContext) -> Optional[AutoInterval]:
        interval, storage = self._checkpoint.interval, self._checkpoint.storage_interval
        storage_auto = storage is not None and storage.auto and self._store.persist_behind
        if not (interval.auto or storage_auto) or not context.is_rank_zero:
            return None
        # Until record_start reads the run's own count: the restarts this process can see for itself.
        return AutoInterval(
            interval.min_steps or AUTO_MIN_STEPS,
            interval.max_steps or AUTO_MAX_STEPS,
            interval.expected_seconds_between_failures or AUTO_PRIOR_SECONDS_BETWEEN_FAILURES,
            failures=context.attempt - 1 + context.restart_count,
            memory_auto=interval.auto,
            storage_auto=storage_auto,
            pod_losses=context.attempt - 1,
            max_steps_asked=interval.max_steps is not None,
        )

    def count_start(self, run: str) -> None:
        """Rank 0: read and count this start in the run's starts.json, for the auto interval's failure rate."""
        if self.auto is None:
            return
        try:
            started, before = self._store.record_start(run)
        except Exception as error:  # storage trouble shows up again, and is reported, in the resume that follows
            log.warning(
                "cannot count this start in %s (%s): the auto checkpoint interval counts %d failures",
                self._store.uri,
                type(error).__name__,
                self.auto.failures,
            )
            return
        self.auto.run_started = min(started, self.auto.run_started)
        self.auto.failures = max(before, self.auto.failures)

    def resumed(self, step: int, save_cost: object) -> None:
        """The run resumed from `step`, whose save cost the process before measured (`save_cost`: a float, or not)."""
        self._last_saved_step = step
        if self.auto is not None and isinstance(save_cost, float):
            self.auto.carry_cost(save_cost)

    @property
    def save_cost(self) -> Optional[float]:
        """What a save costs training, as measured (None: not yet, or not auto)."""
        return self.auto.save_cost if self.auto is not None else None

    def due(self, step: int, save_finished: bool) -> bool:
        """Whether a periodic save is due at `step` (this rank's view: `Run.agree` makes it every rank's).
        `save_finished`: no save is in flight now."""
        interval = self._checkpoint.interval
        if self.auto is not None:
            self._time_step(save_finished)
        if self.auto is not None and self.auto.memory_auto:
            save = self.auto.due(step - self._last_saved_step)
        else:
            save = isinstance(interval.steps, int) and step % interval.steps == 0
        return save or (interval.seconds is not None and time.monotonic() - self._last_save >= interval.seconds)

    def saved(self, step: int) -> None:
        """A save of `step` began now."""
        self._last_save = time.monotonic()
        self._last_saved_step = step
        self._beside_save = True

    def _time_step(self, save_finished: bool) -> None:
        """The auto interval learns the step that ended now (from one agreement to the next), and what a save and a
        copy to storage cost; a storage interval that is auto takes its new choice."""
        chooser, metrics = self.auto, self._store.metrics
        assert chooser is not None
        now = time.monotonic()
        copies = metrics.persists + metrics.failed_persists - self._copies_seen
        persisting = self._store.persisting
        beside_persist = chooser.storage_auto and (self._beside_persist or persisting or copies > 0)
        if self._step_began is not None:
            chooser.step(now - self._step_began, self._beside_save, beside_persist)
        self._step_began = now
        if self._beside_save and save_finished:
            chooser.save_finished(metrics.last_save_seconds)
        self._beside_save = not save_finished
        self._beside_persist = persisting
        if beside_persist and not persisting:
            self._copies_seen += copies
            chooser.persist_finished(copies, metrics.last_persist_seconds if metrics.persists else None)
            self._choose_storage_interval(chooser)

    def _choose_storage_interval(self, chooser: AutoInterval) -> None:
        chosen = chooser.storage_steps()
        self._store.set_storage_interval(chosen)
        if chosen == self._told_storage_steps:
            return
        self._told_storage_steps = chosen
        log.info(
            "storage interval (auto): %s; a copy to storage costs training %.3f s and takes %.2f s",
            f"every {chosen} steps" if chosen else "every checkpoint, at storage's pace",
            chooser.persist_cost or 0.0,
            chooser.persist_seconds or 0.0,
        )

    def choice(self) -> Optional[IntervalChoice]:
        """With checkpoint.interval.steps: auto, on rank 0: the interval now and what it is made of."""
        return self.auto.choice() if self.auto is not None else None

    def waited_for_the_save_before(self, step: int, seconds: float) -> None:
        """The save of `step` waited `seconds` for the one before it to commit: counted, and said once."""
        self.wait_seconds += seconds
        if self._told_waiting:
            return
        self._told_waiting = True
        interval = self._checkpoint.interval
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
            self._store.metrics.last_save_seconds,
            every,
        )
