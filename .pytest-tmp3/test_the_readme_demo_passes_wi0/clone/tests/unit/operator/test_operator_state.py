"""The operator state's work queue and Event queue, without a server (the kopf handlers around them are tested in
tests/integration and tests/real_api)."""

import logging

import pytest

from trainingrun_operator import reconcile
from trainingrun_operator import state as state_module
from trainingrun_operator.settings import Settings


@pytest.mark.asyncio
async def test_a_run_triggered_many_times_while_queued_is_reconciled_once():
    state = state_module.OperatorState(Settings())
    for _ in range(3):
        state.enqueue(("team", "a"))
    state.enqueue(("team", "b"))
    assert state.work.qsize() == 2
    assert state.work.get_nowait() == ("team", "a")
    state.queued.discard(("team", "a"))  # a worker took it: a new trigger queues it again
    state.enqueue(("team", "a"))
    assert state.work.qsize() == 2


@pytest.mark.asyncio
async def test_events_past_the_queue_limit_are_logged_and_counted_not_raised(monkeypatch, caplog):
    monkeypatch.setattr(state_module, "EVENTS_QUEUED_MAX", 2)
    state = state_module.OperatorState(Settings())
    body = {"metadata": {"name": "a", "namespace": "team", "uid": "u"}}
    with caplog.at_level(logging.WARNING, logger="trainingrun.operator"):
        for n in range(3):
            state.queue_event(body, reconcile.Note("Normal", "AttemptStarted", f"attempt {n}"))
    assert state.events.qsize() == 2
    assert state.metrics.events_dropped._value.get() == 1
    assert "team/a: AttemptStarted: attempt 2 (not posted as an Event" in caplog.text


def test_a_replica_that_stands_by_forgets_what_it_wrote_and_decided():
    """Another replica acts meanwhile: when this one acts again, what it wrote before must not be laid over what the
    other wrote since (an older attempt number would start that attempt again)."""
    state = state_module.OperatorState(Settings())
    key = ("team", "a")
    state.acting_changed(True)
    state.written[key] = {"attempt": 1, "jobName": "a-a1"}
    state.reconciled[key] = state_module.Reconciled(42, {})
    state.rechecks.at(key, 0.0)
    state.acting_changed(True)  # still acting: nothing forgotten
    assert state.written[key] and state.reconciled[key].run == 42
    state.acting_changed(False)
    assert state.written == {} and state.reconciled == {} and state.rechecks.due(1.0) == []
    assert state.metrics.acting._value.get() == 0
