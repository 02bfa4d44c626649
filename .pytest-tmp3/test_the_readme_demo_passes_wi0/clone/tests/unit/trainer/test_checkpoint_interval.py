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
        bounds.get("min_steps", 5),
        bounds.get("max_steps", 10_000),
        3600,
        failures=failures,
        clock=clock or Clock(),
        max_steps_asked=bounds.get("asked", False),
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


def test_the_interval_is_never_shorter_than_a_commit_not_even_under_the_default_max_steps():
    # a cheap save (cost 0.01 s: Young's rule says every 85 steps, 8.5 s) whose write takes 30 s to commit
    policy = measured(cost_steps=(0.11,), usual=0.1, commit=30.0, max_steps=100)
    assert policy.commit_seconds == 30.0
    assert policy.steps() == math.ceil(30.0 * COMMIT_MARGIN / 0.1) == 375  # 37.5 s: the commit fits in it
    assert measured(cost_steps=(0.11,), usual=0.1, commit=None, max_steps=100).steps() == 85  # no commit measured


def test_a_max_steps_the_user_set_is_kept_even_when_a_commit_takes_longer():
    """A bound the user asked for (checkpoint.interval.maxSteps): on main a slow commit stretched the interval past it
    (36 steps under maxSteps 25 on a busy machine); the wait it costs is said and counted instead."""
    assert measured(cost_steps=(0.11,), usual=0.1, commit=30.0, max_steps=100, asked=True).steps() == 100
    assert measured(cost_steps=(0.11,), usual=0.1, commit=30.0, max_steps=1000, asked=True).steps() == 375
    assert measured(cost_steps=(0.11,), usual=0.1, commit=1.0, max_steps=100, asked=True).steps() == 85


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


def copied(copy_steps=(0.3, 0.3), with_save=(), usual=0.1, copies=1, copy_seconds=0.05, pod_losses=0, failures=0):
    """A storage interval that saw 10 usual steps, then one copy to storage beside `with_save` (steps beside a save
    as well) and `copy_steps` (beside the copy alone)."""
    policy = AutoInterval(
        5, 10_000, 3600, memory_auto=False, storage_auto=True, pod_losses=pod_losses, failures=failures, clock=Clock()
    )
    for _ in range(10):
        policy.step(usual, beside_save=False)
    for seconds in with_save:
        policy.step(seconds, beside_save=True, beside_persist=True)
    for seconds in copy_steps:
        policy.step(seconds, beside_save=False, beside_persist=True)
    policy.persist_finished(copies, copy_seconds)
    return policy


def test_until_a_copy_is_measured_every_checkpoint_is_copied():
    policy = AutoInterval(5, 10_000, 3600, memory_auto=False, storage_auto=True, clock=Clock())
    for _ in range(10):
        policy.step(0.1, beside_save=False)
    assert policy.storage_steps() is None
    choice = policy.choice()
    assert choice.storage_steps is None and choice.steps is None  # checkpoint.interval is not auto: not reported
    assert choice.seconds_between_pod_losses == 3600


def test_a_copys_cost_is_the_slowdown_of_the_steps_beside_it_alone_scaled_to_every_step_it_ran_beside():
    # (0.3 - 0.1) x 2 over the two steps beside the copy alone, scaled to the three it ran beside, for two copies
    policy = copied(copy_steps=(0.3, 0.3), with_save=(1.0,), copies=2)
    assert policy.persist_cost == pytest.approx(0.4 * 3 / 2 / 2)
    assert policy.step_seconds == pytest.approx(0.1)  # the steps beside the copy are not usual steps
    assert copied(copies=0).persist_cost is None  # none done or failed: nothing to charge
    assert copied(copy_steps=(), with_save=(1.0,)).persist_cost == 0.0  # only beside the save: the save's cost has it
    assert copied(copy_steps=(), with_save=()).persist_cost is None  # beside no step seen: nothing measured


def test_the_storage_interval_follows_youngs_rule_on_pod_losses_not_on_restarts_inside_the_pod():
    quiet = copied()  # a copy costs 0.4 s, a step 0.1 s, no pod lost: the prior's hour
    young = round(math.sqrt(2 * 0.4 * 3600) / 0.1)
    assert quiet.storage_steps() == young
    assert copied(failures=5).storage_steps() == young  # restarts in place resume from memory
    lost = copied(pod_losses=2)
    lost.clock.now += 600  # two pod losses in 10 minutes
    assert lost.storage_steps() == round(math.sqrt(2 * 0.4 * 300) / 0.1) < young
    choice = lost.choice()
    assert (choice.storage_steps, choice.persist_cost_seconds, choice.seconds_between_pod_losses) == (
        lost.storage_steps(),
        0.4,
        300.0,
    )


def test_the_storage_interval_is_never_shorter_than_a_copy_takes():
    cheap = copied(copy_steps=(0.1, 0.1), copy_seconds=2.0)  # costs training nothing, takes 2 s
    assert cheap.persist_cost == 0.0
    assert cheap.storage_steps() == math.ceil(2.0 * COMMIT_MARGIN / 0.1)
