"""Finding a straggler: a rank that keeps every other rank waiting because its own part of each step is slower.

What is measured (`ComputeTimer`): each rank's time from the start of a step to its first collective of the step,
the per-step agreement (`Run.agree_async`, started after the last forward pass): the data wait and the forward passes
(and, with gradient accumulation, the backward passes that do not synchronise). No collective lies inside it, so a
fast rank does not absorb the slow one's time by waiting for it, as it does in the whole step's time. On a GPU the
time between two CUDA events around it, read once the device has passed them (`Event.query`): never a device sync.

How the ranks learn each other's times: each rank writes its own in its slot of the agreement's all-reduce (MAX of
zeros and one value per slot), so the step pays no extra collective (`agreement_slots`, `read_slots`).

When a rank is named (`StragglerWatch`, rank 0): its median over the last WINDOW_STEPS steps is at least
spec.recovery.slowRankFactor times the median of the other ranks' (of two ranks: the other's), and at least MIN_GAP_SECONDS more, for SUSTAIN_SECONDS in a
row; it stops being named once that has not held for SUSTAIN_SECONDS. Medians, so one slow batch or a garbage
collection is not a straggler.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy

#: Steps whose times make each rank's typical time.
WINDOW_STEPS = 16
#: Seconds the slowest rank must stay past the factor before it is named (and below it before it no longer is).
SUSTAIN_SECONDS = 30.0
#: A rank slower by less than this many seconds a step is never named: timer noise on very short steps.
MIN_GAP_SECONDS = 0.001
#: Above this many ranks the agreement carries no times (its all-reduce would grow by 4 bytes a rank, every step).
MAX_TIMED_RANKS = 4096
#: The ranks are compared at most this often (rank 0, in the step's path).
COMPARE_SECONDS = 1.0
#: CUDA event pairs a `ComputeTimer` keeps while the device has not passed them yet.
PENDING_EVENTS = 4


@dataclass(frozen=True)
class Spread:
    """How the ranks' pre-collective times compare over the window."""

    slowest_rank: int
    slowest_seconds: float  #: its median
    median_seconds: float  #: the median of the other ranks' medians

    @property
    def ratio(self) -> float:
        """The slowest rank's time over the other ranks' median (1.0: every rank alike)."""
        return self.slowest_seconds / self.median_seconds if self.median_seconds > 0 else 1.0


def agreement_slots(own_seconds: Optional[float], rank: int, world_size: int) -> list[float]:
    """This rank's part of the agreement's times: its own time in its slot, zeros elsewhere (0: not measured)."""
    if world_size > MAX_TIMED_RANKS:
        return []
    slots = [0.0] * world_size
    if own_seconds is not None and math.isfinite(own_seconds) and own_seconds > 0:
        slots[rank] = float(own_seconds)
    return slots


def read_slots(values: Any) -> numpy.ndarray:
    """Every rank's time from the reduced slots (NaN: that rank measured none)."""
    times = numpy.array(values, dtype=numpy.float64)
    times[~(times > 0)] = numpy.nan
    return times


class ComputeTimer:
    """Times a step's part before its first collective without waiting for a device. `start()` at the step's start,
    `stop()` at the collective: the newest finished measurement (on a GPU, the newest pair of events the device has
    passed, so it may be a step or two old; None until one has)."""

    def __init__(self, device: Any = None, now: Callable[[], float] = time.perf_counter):
        self._now = now
        self._cuda = getattr(device, "type", None) == "cuda"
        self._started = 0.0
        self._start_event: Any = None
        self._pending: deque[tuple[Any, Any]] = deque(maxlen=PENDING_EVENTS)
        self._latest: Optional[float] = None

    def start(self) -> None:
        if not self._cuda:
            self._started = self._now()
            return
        import torch

        self._start_event = torch.cuda.Event(enable_timing=True)
        self._start_event.record()

    @property
    def latest(self) -> Optional[float]:
        """The newest finished measurement (None: none yet)."""
        return self._latest

    def stop(self) -> Optional[float]:
        if not self._cuda:
            self._latest = self._now() - self._started
            return self._latest
        import torch

        if self._start_event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._start_event, end))
            self._start_event = None
        while self._pending and self._pending[0][1].query():  # passed: reading it does not wait
            began, ended = self._pending.popleft()
            self._latest = began.elapsed_time(ended) / 1000.0
        return self._latest


class StragglerWatch:
    """Rank 0's view of every rank's pre-collective time (`observe` each agreed step); `named` is the straggler now
    (None: none). `factor`: spec.recovery.slowRankFactor."""

    def __init__(self, world_size: int, factor: float, now: Callable[[], float] = time.monotonic):
        self.world_size = world_size
        self.factor = factor
        self._now = now
        #: The last WINDOW_STEPS steps' times, a row a step (NaN: not measured), filled in turn.
        self._times = numpy.full((WINDOW_STEPS, world_size), numpy.nan)
        self._row = 0
        self._compared_at = -math.inf
        self.spread: Optional[Spread] = None  #: the newest comparison (None: fewer than two ranks measured)
        self.named: Optional[Spread] = None
        #: The step since which `named` is slow (or, when none is, the step at which the last stopped being named).
        self.named_step = 0
        self._candidate: Optional[int] = None  #: the rank past the factor now, and since when
        self._candidate_since = 0.0
        self._candidate_step = 0
        self._calm_since: Optional[float] = None  #: while one is named: since when none has been past the factor

    def observe(self, step: int, times: Any) -> bool:
        """One step's times, by rank (`read_slots`'s, or a sequence with None for a rank that measured none); True
        when `named` changed (a straggler named, another one, or none any more), and at the first comparison, which
        says none is (a new worker group's rank 0 knows nothing of the last's). The ranks are compared at most once
        every COMPARE_SECONDS: a comparison of thousands of ranks is not for every step."""
        row = times if isinstance(times, numpy.ndarray) else numpy.array([numpy.nan if t is None else t for t in times])
        self._times[self._row % WINDOW_STEPS, :] = row[: self.world_size]
        self._row += 1
        first = self.spread is None
        if not first and self._now() - self._compared_at < COMPARE_SECONDS:
            return False
        self._compared_at = self._now()
        self.spread = self._compare()
        if self.spread is None:
            return False
        changed = self._follow(step, self.spread if self._past_factor(self.spread) else None)
        if first:
            self.named_step = step
        return changed or first

    def _follow(self, step: int, slow: Optional[Spread]) -> bool:
        now = self._now()
        if slow is None:
            self._candidate = None
            if self.named is None:
                return False
            self._calm_since = now if self._calm_since is None else self._calm_since
            if now - self._calm_since < SUSTAIN_SECONDS:
                return False
            self.named, self.named_step, self._calm_since = None, step, None
            return True
        self._calm_since = None
        if self._candidate != slow.slowest_rank:
            self._candidate, self._candidate_since, self._candidate_step = slow.slowest_rank, now, step
        if now - self._candidate_since < SUSTAIN_SECONDS:
            return False
        changed = self.named is None or self.named.slowest_rank != slow.slowest_rank
        self.named = slow
        if changed:
            self.named_step = self._candidate_step
        return changed

    def _past_factor(self, spread: Spread) -> bool:
        return (
            spread.slowest_seconds >= self.factor * spread.median_seconds
            and spread.slowest_seconds - spread.median_seconds >= MIN_GAP_SECONDS
        )

    def _compare(self) -> Optional[Spread]:
        measured = numpy.flatnonzero((~numpy.isnan(self._times)).sum(axis=0) >= 3)  # ranks with 3 times or more
        if len(measured) < 2:
            return None
        typical = numpy.nanmedian(self._times[:, measured], axis=0)
        slowest = int(numpy.argmax(typical))
        others = numpy.delete(typical, slowest)
        return Spread(int(measured[slowest]), float(typical[slowest]), float(numpy.median(others)))
