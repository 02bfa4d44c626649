"""checkpoint_interval.AutoInterval: Young's rule from measured save costs, step times and failures."""

import math

import pytest

from trainingrun_trainer.checkpoint_interval import COMMIT_MARGIN, MIN_STEPS_MEASURED, AutoInterval


class Clock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


def measured(cost_steps=(0.5, 0.2), usual=0.1, failures=0, clock=None, commit=None, **bounds):
    """An interval that saw 10 usual steps, then one save beside `cost_steps`, committed `commit` s after save()."""
    policy = AutoInterval(
        bounds.get("min_steps", 5), bounds.get("max_steps", 10_000), 3600, failures=failures, clock=clock or Clock()
    )
    for _ in range(10):
        policy.step(usual, beside_save=False)
    for seconds in cost_steps:
        policy.step(seconds, beside_save=True)
    policy.save_finished(commit)
    return policy


def test_until_a_save_and_steps_are_measured_the_interval_is_the_minimum():
    policy = AutoInterval(7, 1000, 3600)
    assert policy.steps() == 7 and policy.due(7) and not policy.due(6)
    for _ in range(MIN_STEPS_MEASURED):
        policy.step(0.1, beside_save=False)
    assert policy.save_cost is None and policy.steps() == 7  # steps known, cost not
    choice = policy.choice()
    assert choice.steps == 7 and choice.save_cost_seconds is None and choice.failures == 0


def test_a_saves_cost_is_what_its_steps_took_beyond_the_usual_step():
    policy = measured(cost_steps=(0.5, 0.2), usual=0.1)
    assert policy.save_cost == pytest.approx(0.5)  # (0.5 - 0.1) + (0.2 - 0.1)
    assert measured(cost_steps=(0.05,), usual=0.1).save_cost == 0.0  # never negative


def test_youngs_rule_before_the_first_failure_uses_the_prior():
    policy = measured()  # cost 0.5 s, step 0.1 s, no failure, prior 3600 s
    expected = math.sqrt(2 * 0.5 * 3600) / 0.1
    assert policy.steps() == round(expected)
    choice = policy.choice()
    assert choice.seconds == pytest.approx(round(expected) * 0.1)
    assert choice.expected_lost_seconds == pytest.approx(choice.seconds / 2)
    assert choice.seconds_between_failures == 3600


def test_failures_shorten_the_interval_and_a_long_quiet_run_lengthens_it():
    clock = Clock(1000.0)
    policy = measured(clock=clock, failures=0)
    clock.now += 7200  # two hours without a failure: longer than the prior
    assert policy.seconds_between_failures() == pytest.approx(7200)
    quiet = policy.steps()
    policy.failures = 4
    assert policy.seconds_between_failures() == pytest.approx(1800)
    assert policy.steps() == round(math.sqrt(2 * 0.5 * 1800) / 0.1) < quiet


def test_the_interval_stays_within_its_bounds():
    assert measured(cost_steps=(100.0,), max_steps=50).steps() == 50
    assert measured(cost_steps=(0.1,), min_steps=40).steps() == 40  # a free save: as often as allowed


def test_the_interval_is_never_shorter_than_a_commit_not_even_under_max_steps():
    # a cheap save (cost 0.01 s: Young's rule says every 85 steps, 8.5 s) whose write takes 30 s to commit
    policy = measured(cost_steps=(0.11,), usual=0.1, commit=30.0, max_steps=100)
    assert policy.commit_seconds == 30.0
    assert policy.steps() == math.ceil(30.0 * COMMIT_MARGIN / 0.1) == 375  # 37.5 s: the commit fits in it
    assert measured(cost_steps=(0.11,), usual=0.1, commit=None, max_steps=100).steps() == 85  # no commit measured


def test_a_cost_carried_from_an_earlier_process_counts_until_this_one_measures_its_own():
    policy = AutoInterval(5, 10_000, 3600)
    policy.carry_cost(0.5)
    policy.carry_cost(float("nan"))  # ignored
    for _ in range(MIN_STEPS_MEASURED):
        policy.step(0.1, beside_save=False)
    assert policy.save_cost == 0.5 and policy.steps() == round(math.sqrt(2 * 0.5 * 3600) / 0.1)


def test_slow_first_steps_do_not_set_the_step_time():
    policy = AutoInterval(5, 10_000, 3600)
    for seconds in (5.0, 2.0, 0.1, 0.1, 0.1):  # allocation, warm-up, then the usual step
        policy.step(seconds, beside_save=False)
    assert policy.step_seconds == pytest.approx(0.1)
