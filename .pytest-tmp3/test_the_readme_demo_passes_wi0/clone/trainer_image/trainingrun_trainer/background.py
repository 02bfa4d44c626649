"""Background threads give way to the training thread.

Why: the trainer's helper threads (the one that reads batches ahead, the read-ahead's fetch pool, the tracker's
delivery thread) work ahead of time by design, so a few milliseconds' delay costs them nothing, while the same delay
on the training thread is lost training time. Linux's scheduler does not know that: a helper woken by the training
thread (taking a batch from a full queue wakes the thread that refills it) preempts the thread that woke it, since a
thread that slept is owed CPU, whenever the step's own compute threads fill the other cores. On the 2-core benchmark
VM that preemption was nearly all of the data wait: 1.7 ms a step (1.6% of step time) with the next batch already
made; with the helpers at +5 it is 0.13% (benchmarks/data_loading.py, synthetic data), and steps are no slower.
At +5 a helper still gets a third of a nice-0 thread's share when they compete, far more than reading ahead needs.
"""

from __future__ import annotations

import os
import threading

__all__ = ["BACKGROUND_NICENESS", "give_way_to_training", "helper_niceness"]

#: How much nicer than the process (its main thread) a background helper runs: weight 335 against 1024 at +5.
BACKGROUND_NICENESS = 5


def helper_niceness() -> int:
    """The nice value a helper thread runs at: BACKGROUND_NICENESS above the process's main thread (on Linux,
    the process's pid names its main thread), at most 19."""
    return min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + BACKGROUND_NICENESS)


def give_way_to_training() -> None:
    """Run the calling thread at helper_niceness() (idempotent: threads that this one starts inherit its value, and
    calling it again there changes nothing). Where per-thread priorities do not exist (not Linux) or may not be
    changed, the thread runs as it was."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), helper_niceness())
    except (AttributeError, OSError):
        pass
