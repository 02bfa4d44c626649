"""ProcessClock (timekeeping.py): what a training process reports about its own time."""
import os
import subprocess
import sys
import time

from trainingrun_trainer import timekeeping


def test_the_process_start_is_read_from_the_system_not_from_the_import():
    """A child that sleeps before importing the module still reports the time since it started."""
    code = ("import time; time.sleep(1.5); from trainingrun_trainer import timekeeping; "
            "print(time.monotonic() - timekeeping.process_started())")
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               env={**os.environ}).stdout)
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
