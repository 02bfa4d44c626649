"""The recovery policy both the operator and `trainingrun local` follow (trainingrun_operator/recovery.py)."""

from trainingrun_operator import api
from trainingrun_operator.recovery import Restarts, after_attempt, backoff_seconds


def test_backoff_is_exponential_and_capped():
    policy = api.Recovery(backoffSeconds=10, maxBackoffSeconds=60)
    assert [backoff_seconds(policy, n) for n in (1, 2, 3, 4, 5)] == [10, 20, 40, 60, 60]


def test_each_cause_is_charged_to_its_own_budget_with_the_backoff_of_all_restarts():
    policy = api.Recovery(backoffSeconds=10, maxBackoffSeconds=600, maxFailures=2, maxPreemptions=5)
    failed = after_attempt(policy, Restarts(failures=1, preemptions=2), "failure")
    assert failed.retry and failed.restarts == Restarts(2, 2) and failed.counter == "failures"
    assert failed.delay_seconds == 80  # the 4th restart of the run: 10 * 2**3
    preempted = after_attempt(policy, Restarts(failures=2, preemptions=0), "preemption")
    assert preempted.retry and preempted.restarts == Restarts(2, 1) and preempted.budget_field == "maxPreemptions"


def test_a_spent_budget_stops_and_says_which_field_to_raise():
    policy = api.Recovery(maxFailures=2)
    spent = after_attempt(policy, Restarts(failures=2), "failure")
    assert not spent.retry and spent.stop_reason == "FailureBudgetSpent" and spent.delay_seconds == 0
    assert spent.budget_words() == "spec.recovery.maxFailures=2 is spent (3 failures); raise it to allow more"
    none_allowed = after_attempt(api.Recovery(maxPreemptions=0), Restarts(), "preemption")
    assert not none_allowed.retry and none_allowed.stop_reason == "PreemptionBudgetSpent"


def test_a_permanent_error_stops_without_charging_a_budget():
    decision = after_attempt(api.Recovery(), Restarts(failures=1), "permanent")
    assert not decision.retry and decision.stop_reason == "PermanentError" and decision.restarts == Restarts(failures=1)


def test_restarts_round_trip_through_status():
    status = {"failures": 2, "preemptions": 1, "total": 3, "inPlace": 4}
    assert Restarts.from_status(status).as_status() == {"failures": 2, "preemptions": 1, "total": 3}
    assert Restarts.from_status(None) == Restarts()
