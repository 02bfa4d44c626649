"""background.give_way_to_training: helper threads run nicer than the training thread, so waking one does not cost
the training thread its CPU."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from trainingrun_trainer.background import BACKGROUND_NICENESS, give_way_to_training, helper_niceness

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def niceness_of_a_thread(target=lambda: None) -> int:
    """The nice value a new thread has after running `target`."""
    seen = []

    def run():
        target()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    return seen[0]


def test_a_helper_thread_runs_nicer_than_the_process_and_the_process_stays_as_it_was():
    process = os.getpriority(os.PRIO_PROCESS, os.getpid())
    assert niceness_of_a_thread(give_way_to_training) == helper_niceness() == min(19, process + BACKGROUND_NICENESS)
    assert os.getpriority(os.PRIO_PROCESS, os.getpid()) == process
    assert niceness_of_a_thread() == process  # an ordinary thread is untouched


def test_giving_way_twice_does_not_lower_the_thread_further():
    process = os.getpriority(os.PRIO_PROCESS, os.getpid())

    def twice():
        give_way_to_training()
        give_way_to_training()

    assert niceness_of_a_thread(twice) == min(19, process + BACKGROUND_NICENESS)
