"""`checkpoint.interval.steps: auto`: the checkpoint interval that loses the least training time.

Each save costs the training loop some seconds C: the time the steps beside it took beyond a usual step, so the
blocking part (staging) and the slowdown of steps next to the background write both count. Each failure throws away
the steps since the last checkpoint, half an interval on average. With M the mean time between failures, the
interval that minimises the sum is T = sqrt(2 x C x M) (Young 1974; Daly 2006 adds terms that matter only when C is
near M, which min/max bounds keep away).

Everything is measured in the run itself:
- C: the median of the last saves' costs (one save's cost is carried across restarts in the checkpoint);
- the step time that turns T into steps: the median of recent steps with no save beside them;
- M = seconds since the run started / failures so far (the maximum-likelihood estimate for failures that come at
  random); before the first failure, the prior (`expectedSecondsBetweenFailures`) or the time run so far, whichever
  is longer. A failure is a restart of the training processes (see `CheckpointStore.record_start`). A prior that
  kept counting after real failures would hide a high failure rate for a long time (1 h against a failure every
  30 s is still 20 min after 2 failures), which is when the interval matters most.

Until a save's cost and a few steps have been measured the interval is `min_steps`, so the first save comes early
and measures C. Rank 0 decides; `Run.agree` makes every rank save at the same step.

Whatever T comes out, the interval is never shorter than COMMIT_MARGIN commits (save() to committed, the median of
the last saves): a save that comes before the one before it has committed waits for it, holding training back. This
bound wins over the default `max_steps`, not over one the user set (`max_steps_asked`): that is a bound they asked
for, so it is kept, and the trainer says once that checkpoints wait for commits (session_intervals).

`checkpoint.storageInterval.steps: auto` (persisting behind) is the same trade one tier down: how many steps apart a
checkpoint committed in memory is also copied to storage. A copy costs the training loop the slowdown of the steps
beside it (the copy runs on rank 0's persister thread, sharing the node's cores and memory bandwidth); what a
failure throws away is what the memory tier cannot give back, so only failures that lose the node's memory count: a
new attempt (new pods). Restarts inside the pod resume from memory and cost the storage interval nothing. The copy
is never asked for more often than one takes (COMMIT_MARGIN copies): faster, newer checkpoints would only supersede
the waiting one.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Callable, Optional

from trainingrun_api.progress_report import IntervalChoice

#: Steps without a save beside them that the usual step time is taken from.
STEP_WINDOW = 64
#: Saves whose median cost is used.
COST_WINDOW = 5
#: Steps measured before the step time is trusted (the first steps of a process are slow: allocation, warm-up).
MIN_STEPS_MEASURED = 3
#: The interval is at least this many commit times, so that a commit a little slower than the last ones does not
#: hold training back either.
COMMIT_MARGIN = 1.25
#: The longest storage interval auto chooses, in steps (the memory interval's default maxSteps).
AUTO_MAX_STORAGE_STEPS = 100_000


class SaveCosts:
    """What saves cost the steps beside them: each save's time beyond a usual step, from the steps' own times.

    The training loop calls `step` after each step and `save_finished` once the save beside the last steps is done.
    Both the auto interval (wall time of whole steps: blocking and slowdown) and the trainer's time breakdown
    (compute time only: the slowdown that the background write caused, charged to "checkpoint") measure with it.

    Persisting behind, it also measures what copies to storage cost: `step(..., beside_persist=True)` while rank 0's
    persister copies, `persist_finished` when it went idle. A step beside a save and a copy is charged to the save;
    the copy's cost is the slowdown of the steps beside it alone, scaled to all the steps it ran beside (0 when it ran
    beside none alone: a copy that ended within the steps of the save that queued it)."""

    def __init__(self) -> None:
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self._costs: deque[float] = deque(maxlen=COST_WINDOW)
        self._commits: deque[float] = deque(maxlen=COST_WINDOW)
        self._beside_save: list[float] = []
        self._persist_costs: deque[float] = deque(maxlen=COST_WINDOW)
        self._persist_durations: deque[float] = deque(maxlen=COST_WINDOW)
        self._beside_persist_only: list[float] = []
        self._beside_persist = 0  # steps beside the copies in progress, beside a save as well or not

    def step(self, seconds: float, beside_save: bool, beside_persist: bool = False) -> None:
        """One step took `seconds`; `beside_save`: a save was staged or written during it; `beside_persist`: a copy
        to storage ran during it."""
        self._beside_persist += beside_persist
        if beside_save:
            self._beside_save.append(seconds)
        elif beside_persist:
            self._beside_persist_only.append(seconds)
        else:
            self._steps.append(seconds)

    def persist_finished(self, copies: int, copy_seconds: Optional[float]) -> Optional[float]:
        """The persister went idle after `copies` copies to storage (done or failed), the last one done taking
        `copy_seconds` (None: none done): returns what one copy cost the training loop (0 when every step beside the
        copies was beside a save too: the save's cost has them), None when it could not be told (no usual step time
        yet, or no step seen beside the copies)."""
        alone, beside = self._beside_persist_only, self._beside_persist
        self._beside_persist_only, self._beside_persist = [], 0
        if copies < 1:
            return None
        if copy_seconds is not None and math.isfinite(copy_seconds) and copy_seconds > 0:
            self._persist_durations.append(copy_seconds)
        usual = self.step_seconds
        if usual is None or not beside:
            return None
        # Copies that ended within the steps of the save that queued them (a small state) are charged to that save.
        slowdown = max(0.0, sum(alone) - usual * len(alone)) * beside / len(alone) if alone else 0.0
        self._persist_costs.append(slowdown / copies)
        return self._persist_costs[-1]

    @property
    def persist_cost(self) -> Optional[float]:
        """What one copy to storage costs the training loop, the median of the last copies."""
        return statistics.median(self._persist_costs) if self._persist_costs else None

    @property
    def persist_seconds(self) -> Optional[float]:
        """How long one copy to storage takes, the median of the last copies."""
        return statistics.median(self._persist_durations) if self._persist_durations else None

    def save_finished(self, commit_seconds: Optional[float] = None) -> float:
        """The save whose steps were reported `beside_save` is committed (or failed), `commit_seconds` after save()
        (None: not known): returns its cost, 0 while no usual step time is known yet."""
        if commit_seconds is not None and math.isfinite(commit_seconds) and commit_seconds > 0:
            self._commits.append(commit_seconds)
        usual = self.step_seconds
        cost = 0.0
        if self._beside_save and usual is not None:
            cost = max(0.0, sum(self._beside_save) - usual * len(self._beside_save))
            self._costs.append(cost)
        self._beside_save = []
        return cost

    def carry_cost(self, seconds: float) -> None:
        """A save's cost measured by an earlier process of the run (from the checkpoint it resumed from)."""
        if math.isfinite(seconds) and seconds >= 0:
            self._costs.append(seconds)

    @property
    def save_cost(self) -> Optional[float]:
        return statistics.median(self._costs) if self._costs else None

    @property
    def commit_seconds(self) -> Optional[float]:
        """save() to committed, the median of the last saves."""
        return statistics.median(self._commits) if self._commits else None

    @property
    def step_seconds(self) -> Optional[float]:
        return statistics.median(self._steps) if len(self._steps) >= MIN_STEPS_MEASURED else None


class AutoInterval(SaveCosts):
    """Chooses the interval from measured save costs, step times and failures; the training thread calls it."""

    def __init__(
        self,
        min_steps: int,
        max_steps: int,
        prior_seconds_between_failures: float,
        *,
        failures: int = 0,
        run_started: Optional[float] = None,
        clock: Callable[[], float] = time.time,
        memory_auto: bool = True,
        storage_auto: bool = False,
        pod_losses: int = 0,
        max_steps_asked: bool = False,
    ):
        super().__init__()
        self.min_steps, self.max_steps = min_steps, max_steps
        #: Whether max_steps is the user's (checkpoint.interval.maxSteps), which even a slow commit does not stretch.
        self.max_steps_asked = max_steps_asked
        self.prior_seconds_between_failures = prior_seconds_between_failures
        self.clock = clock
        #: Restarts of the training processes since the run started (this process's start included when it was one).
        self.failures = failures
        #: Which intervals are auto: checkpoint.interval.steps (`steps`, `due`) and checkpoint.storageInterval.steps
        #: (`storage_steps`).
        self.memory_auto, self.storage_auto = memory_auto, storage_auto
        #: Failures that lost the node's memory: attempts before this one.
        self.pod_losses = pod_losses
        #: When the run's first training process started (time.time()).
        self.run_started = clock() if run_started is None else run_started

    def seconds_between_failures(self) -> float:
        return self._mean_time_between(self.failures)

    def _mean_time_between(self, failures: int) -> float:
        """Seconds since the run started / `failures`; before the first, the prior or the time run so far."""
        ran = max(0.0, self.clock() - self.run_started)
        return ran / failures if failures else max(self.prior_seconds_between_failures, ran)

    def steps(self) -> int:
        """The interval now, in steps."""
        cost, step = self.save_cost, self.step_seconds
        if cost is None or not step:
            return self.min_steps
        seconds = math.sqrt(2 * cost * self.seconds_between_failures())
        chosen = max(self.min_steps, min(self.max_steps, round(seconds / step)))
        commit = self.commit_seconds
        if not commit:
            return chosen
        longer = max(chosen, math.ceil(commit * COMMIT_MARGIN / step))
        return min(longer, self.max_steps) if self.max_steps_asked else longer

    def due(self, steps_since_save: int) -> bool:
        return steps_since_save >= self.steps()

    def choice(self) -> IntervalChoice:
        """The intervals that are auto and what they are made of, for status, metrics and the local summary."""
        steps, step, cost = (self.steps() if self.memory_auto else None), self.step_seconds, self.save_cost
        seconds = steps * step if step and steps else None
        storage = self.storage_steps() if self.storage_auto else None
        persist_cost = self.persist_cost if self.storage_auto else None
        return IntervalChoice.model_construct(  # unchecked: reporting never raises in the training loop
            steps=steps,
            seconds=None if seconds is None else round(seconds, 3),
            save_cost_seconds=None if cost is None or not self.memory_auto else round(cost, 4),
            seconds_between_failures=round(self.seconds_between_failures(), 1),
            failures=self.failures,
            expected_lost_seconds=None if seconds is None else round(seconds / 2, 3),
            storage_steps=storage,
            persist_cost_seconds=None if persist_cost is None else round(persist_cost, 4),
            seconds_between_pod_losses=round(self.seconds_between_pod_losses(), 1) if self.storage_auto else None,
        )

    def seconds_between_pod_losses(self) -> float:
        """The mean time between failures that lose the node's memory (new attempts), estimated as
        `seconds_between_failures` is."""
        return self._mean_time_between(self.pod_losses)

    def storage_steps(self) -> Optional[int]:
        """storageInterval.steps: auto: how many steps apart memory checkpoints are copied to storage now; None: every
        one, at storage's pace (until a copy's cost and the step time are measured)."""
        cost, step, copy = self.persist_cost, self.step_seconds, self.persist_seconds
        if cost is None or not step:
            return None
        seconds = math.sqrt(2 * cost * self.seconds_between_pod_losses())
        chosen = min(AUTO_MAX_STORAGE_STEPS, max(1, round(seconds / step)))
        return max(chosen, math.ceil(copy * COMMIT_MARGIN / step)) if copy else chosen
