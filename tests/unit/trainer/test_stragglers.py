"""stragglers: each rank's time travels in its slot of the agreement; rank 0 names a rank that stays past the factor
for SUSTAIN_SECONDS (never one within noise, nor a blip), says when none is any more, and times without a device
wait."""

import math

import pytest
import torch

from trainingrun_trainer import stragglers
from trainingrun_trainer.stragglers import SUSTAIN_SECONDS, WINDOW_STEPS, ComputeTimer, StragglerWatch


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def feed(watch: StragglerWatch, clock: Clock, times, steps: int, first_step: int = 1, seconds_apart: float = 1.0):
    """`steps` agreed steps with `times` by rank; the steps at which `named` changed."""
    changes = []
    for step in range(first_step, first_step + steps):
        clock.now += seconds_apart
        if watch.observe(step, times):
            changes.append(step)
    return changes


def test_each_rank_fills_its_own_slot_and_the_max_reduce_gives_every_ranks_time():
    parts = [stragglers.agreement_slots(seconds, rank, 3) for rank, seconds in enumerate((0.2, None, 0.5))]
    reduced = [max(column) for column in zip(*parts)]  # what the all-reduce (MAX) does
    read = stragglers.read_slots(reduced)
    assert read[0] == 0.2 and math.isnan(read[1]) and read[2] == 0.5
    assert stragglers.agreement_slots(float("nan"), 0, 2) == [0.0, 0.0]  # never a poisoned slot
    assert stragglers.agreement_slots(0.1, 0, stragglers.MAX_TIMED_RANKS + 1) == []


def test_a_rank_past_the_factor_for_the_sustain_time_is_named_with_its_figures():
    clock = Clock()
    watch = StragglerWatch(4, factor=1.5, now=clock)
    times = [0.10, 0.11, 0.10, 0.30]
    changes = feed(watch, clock, times, steps=int(SUSTAIN_SECONDS) + 5)
    # the first comparison says none is slow (a new group's rank 0 knows nothing of the last's); then rank 3
    assert len(changes) == 2 and watch.named is not None
    assert watch.named.slowest_rank == 3
    assert watch.named.ratio == pytest.approx(0.30 / 0.10)  # against the OTHER ranks' median
    assert changes[1] - changes[0] >= SUSTAIN_SECONDS - 1  # not before it lasted
    assert watch.named_step == 3  # since when it was slow, not when it was named


def test_of_two_ranks_the_slower_is_compared_with_the_other():
    clock = Clock()
    watch = StragglerWatch(2, factor=1.5, now=clock)
    feed(watch, clock, [0.1, 0.2], steps=int(SUSTAIN_SECONDS) + 5)
    assert watch.named is not None and watch.named.slowest_rank == 1 and watch.named.ratio == pytest.approx(2.0)


@pytest.mark.parametrize(
    "times",
    [
        [0.10, 0.12, 0.11, 0.14],  # within the factor
        [0.0010, 0.0011, 0.0010, 0.0019],  # past it, by less than MIN_GAP_SECONDS: timer noise on tiny steps
    ],
    ids=["within-factor", "within-noise"],
)
def test_ranks_within_the_factor_or_the_noise_are_never_named(times):
    clock = Clock()
    watch = StragglerWatch(4, factor=1.5, now=clock)
    feed(watch, clock, times, steps=200)
    assert watch.named is None and watch.spread is not None


def test_a_few_slow_steps_are_not_a_straggler():
    clock = Clock()
    watch = StragglerWatch(2, factor=1.5, now=clock)
    feed(watch, clock, [0.1, 0.1], steps=WINDOW_STEPS)
    for start in range(WINDOW_STEPS + 1, 400, 10):  # one slow step in ten: the window's median stays fast
        feed(watch, clock, [0.1, 0.5], steps=1, first_step=start)
        feed(watch, clock, [0.1, 0.1], steps=9, first_step=start + 1)
    assert watch.named is None


def test_a_straggler_that_recovers_is_no_longer_named_after_the_sustain_time():
    clock = Clock()
    watch = StragglerWatch(3, factor=1.5, now=clock)
    feed(watch, clock, [0.1, 0.1, 0.4], steps=int(SUSTAIN_SECONDS) + 5)
    assert watch.named is not None
    recovered = feed(watch, clock, [0.1, 0.1, 0.1], steps=int(SUSTAIN_SECONDS) + WINDOW_STEPS, first_step=100)
    assert watch.named is None and len(recovered) == 1
    assert recovered[0] - 100 >= SUSTAIN_SECONDS  # the window forgets it, then the calm must last
    assert watch.named_step == recovered[0]


def test_ranks_that_measured_nothing_are_left_out():
    clock = Clock()
    watch = StragglerWatch(3, factor=1.5, now=clock)
    feed(watch, clock, [0.1, None, 0.1], steps=50)
    assert watch.spread is not None and watch.spread.slowest_rank in (0, 2)
    watch = StragglerWatch(2, factor=1.5, now=clock)
    assert feed(watch, clock, [0.1, None], steps=50) == []  # one rank alone: nothing to compare
    assert watch.spread is None


def test_the_cpu_timer_measures_from_start_to_stop():
    clock = Clock()
    timer = ComputeTimer(now=clock)
    assert timer.latest is None
    timer.start()
    clock.now += 0.25
    assert timer.stop() == pytest.approx(0.25) and timer.latest == pytest.approx(0.25)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_suite.py runs it)")
def test_the_cuda_timer_reads_the_devices_time_without_ever_waiting_for_it():
    timer = ComputeTimer(torch.device("cuda"))
    x = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any call that waits for the device raises
    try:
        for _ in range(20):
            timer.start()
            for _ in range(10):
                x = (x @ x).tanh()
            timer.stop()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    timer.start()
    timer.stop()  # every earlier pair has been passed now
    assert timer.latest is not None and timer.latest > 0
