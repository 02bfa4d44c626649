"""ProcessClock (timekeeping.py): what a training process reports about its own time."""

import os
import subprocess
import sys
import time

import pytest

from trainingrun_trainer import timekeeping


@pytest.mark.slow
def test_the_process_start_is_read_from_the_system_not_from_the_import():
    """A child that sleeps before importing the module still reports the time since it started."""
    code = (
        "import time; time.sleep(1.5); from trainingrun_trainer import timekeeping; "
        "print(time.monotonic() - timekeeping.process_started())"
    )
    age = float(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**os.environ}
        ).stdout
    )
    assert age >= 1.4


def test_startup_is_the_time_before_training_that_restoring_did_not_take():
    clock = timekeeping.ProcessClock("pod-0")
    clock.started = time.monotonic() - 10.0
    clock.add("restore", 2.5)
    clock.ready()
    snapshot = clock.snapshot()
    assert 7.4 < snapshot.startup_seconds < 9.5 and snapshot.restore_seconds == 2.5
    assert snapshot.alive_seconds >= 10.0 and snapshot.process.startswith(f"pod-0/{os.getpid()}/")
    with clock.timing("checkpoint"):
        pass
    clock.add("compute", -1.0)  # a clock step backwards is no time, never negative time
    assert clock.snapshot().compute_seconds == 0.0


def test_time_recounted_moves_at_most_what_was_counted():
    clock = timekeeping.ProcessClock("pod-0")
    clock.add("compute", 3.0)
    assert clock.recount(1.25, "compute", "checkpoint") == 1.25
    assert clock.seconds["compute"] == 1.75 and clock.seconds["checkpoint"] == 1.25
    assert clock.recount(5.0, "compute", "checkpoint") == 1.75  # never more than compute holds
    assert clock.seconds["compute"] == 0.0 and clock.seconds["checkpoint"] == 3.0
    assert clock.recount(-1.0, "checkpoint", "compute") == 0.0


def test_the_startup_phases_add_up_to_startup_and_the_line_to_the_first_step():
    now = [100.0]
    clock = timekeeping.ProcessClock("pod-0", now=lambda: now[0])  # the process started at 100
    for phase, at in (("imports", 104.0), ("init", 104.5), ("model", 106.0), ("data", 106.25)):
        now[0] = at
        clock.mark(phase)
    with clock.timing("restore"):
        now[0] = 108.25
    now[0] = 108.5
    clock.ready()
    snapshot = clock.snapshot()
    phases = {phase: getattr(snapshot, f"{phase}_seconds") for phase in timekeeping.STARTUP_PHASES}
    assert phases == {"imports": 4.0, "init": 0.5, "model": 1.5, "data": 0.25, "prepare": 0.25}
    assert snapshot.startup_seconds == 6.5 == sum(phases.values()) and snapshot.restore_seconds == 2.0
    assert clock.first_step_done(1.5) == (
        "start-up 10.00 s to the first step: imports 4.00 s, init 0.50 s, model "
        "1.50 s, data 0.25 s, prepare 0.25 s, restore 2.00 s, first step 1.50 s"
    )
    assert clock.snapshot().first_step_seconds == 1.5
