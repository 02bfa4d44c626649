"""rechecks.py: when runs are reconciled without an event."""

import time

import pytest

from trainingrun_operator.runtime import rechecks
from trainingrun_operator.settings import Settings
from trainingrun_operator.state import OperatorState, Rechecks, WarningsRead

A, B = ("ns", "a"), ("ns", "b")


def test_the_earliest_due_time_wins_and_each_run_comes_due_once():
    due = Rechecks()
    due.at(A, 10.0)
    due.at(A, 5.0)  # earlier: replaces
    due.at(A, 20.0)  # later: the reconcile at 5 says what comes next
    due.at(B, 7.0)
    assert due.due(4.9) == []
    assert due.due(7.0) == [A, B]
    assert due.due(100.0) == []  # A's entry for 10 was superseded, not due again
    assert due.scheduled(A) is None


def test_a_forgotten_run_never_comes_due():
    due = Rechecks()
    due.at(A, 1.0)
    due.watch_warnings(A, "a-a1")
    due.warnings_seen[A] = 1
    due.forget(A)
    assert due.due(2.0) == [] and A not in due.watching_warnings["ns"] and A not in due.warnings_seen


def test_warnings_about_a_job_are_its_own_and_its_pods():
    assert rechecks.about_job("run-a1", "run-a1") and rechecks.about_job("run-a1-worker-0", "run-a1")
    assert not rechecks.about_job("run-a10-worker-0", "run-a1") and not rechecks.about_job("run-a", "run-a1")
    one = {"reason": "FailedMount", "message": "m", "involvedObject": {"name": "run-a1-worker-0"}}
    assert rechecks.fingerprint([one]) != rechecks.fingerprint([])
    assert rechecks.fingerprint([one]) == rechecks.fingerprint([dict(one)])


def warning(name, reason="FailedScheduling"):
    return {"reason": reason, "message": "0/3 nodes are available", "involvedObject": {"kind": "Pod", "name": name}}


@pytest.mark.asyncio
async def test_only_runs_whose_warnings_changed_are_reconciled():
    """One read per namespace; a run is queued when the warnings about its job differ from what its last reconcile
    saw, and only then (run-a1's are not run-a10's)."""
    state = OperatorState(settings=Settings(metrics_port=0, reconcile_interval_seconds=60))
    events = [warning("a-a1-worker-0"), warning("b-a10-worker-0"), warning("b-a10", "FailedCreate")]
    state.warnings["ns"] = WarningsRead(time.monotonic(), events)  # fresh: no API call
    state.rechecks.watch_warnings(A, "a-a1")
    state.rechecks.watch_warnings(B, "b-a10")
    state.rechecks.watch_warnings(("ns", "c"), "c-a1")
    state.rechecks.warnings_seen[A] = rechecks.fingerprint([events[0]])  # A's reconcile saw them already
    state.rechecks.warnings_seen[B] = rechecks.fingerprint([events[1]])  # B's saw one of its two
    state.rechecks.warnings_seen[("ns", "c")] = rechecks.fingerprint([])
    await rechecks._wake_on_warnings(state)
    assert state.queued == {B}


class EventsOfOthers:
    """A client whose Warning Events were written by whoever may create Events in the namespace."""

    def __init__(self, events, complete=True):
        self.events, self.complete, self.reads = events, complete, 0

    async def list(self, api_version, kind, namespace, **params):
        self.reads += 1
        return self.events, self.complete


@pytest.mark.asyncio
async def test_what_is_kept_of_a_namespaces_warnings_is_cut_to_size(caplog):
    state = OperatorState(settings=Settings(metrics_port=0, reconcile_interval_seconds=0))
    huge = {
        "reason": "R" * 10_000,
        "message": "m" * 1_000_000,
        "involvedObject": {"kind": "Pod", "name": "n" * 5_000, "uid": "kept-out"},
        "metadata": {"annotations": {"a": "x" * 100_000}},
    }
    state.kube = EventsOfOthers([huge, {"reason": 7, "message": None, "involvedObject": "not a dict"}], complete=False)
    with caplog.at_level("WARNING"):
        kept = await rechecks.namespace_warnings(state, "ns")
        await rechecks.namespace_warnings(state, "ns")  # read again (interval 0): told once while it lasts
    assert kept[0] == {"reason": "R" * 128, "message": "m" * 1024, "involvedObject": {"kind": "Pod", "name": "n" * 253}}
    assert kept[1] == {"reason": None, "message": None, "involvedObject": {"kind": None, "name": None}}
    assert state.kube.reads == 2
    told = [r.getMessage() for r in caplog.records if "more than 2000 Warning Events" in r.getMessage()]
    assert len(told) == 1
