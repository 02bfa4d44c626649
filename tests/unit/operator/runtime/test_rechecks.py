"""rechecks.py: when runs are reconciled without an event."""

import time

import pytest

from trainingrun_operator.runtime import rechecks
from trainingrun_operator.runtime.rechecks import Rechecks, WarningsRead
from trainingrun_operator.settings import Settings
from trainingrun_operator.state import OperatorState

A, B = ("ns", "a"), ("ns", "b")


async def no_warnings(namespace):
    raise AssertionError(f"read {namespace}'s Warning Events")


def rechecks_queuing_into(queued: set, list_warnings=no_warnings, **settings) -> Rechecks:
    """Rechecks with only what they are given: no operator behind them."""
    return Rechecks(queued.add, list_warnings, Settings(metrics_port=0, **settings), clock=lambda: None)


def test_the_earliest_due_time_wins_and_each_run_comes_due_once():
    due = rechecks_queuing_into(set())
    due.at(A, 10.0)
    due.at(A, 5.0)  # earlier: replaces
    due.at(A, 20.0)  # later: the reconcile at 5 says what comes next
    due.at(B, 7.0)
    assert due.due(4.9) == []
    assert due.due(7.0) == [A, B]
    assert due.due(100.0) == []  # A's entry for 10 was superseded, not due again
    assert due.scheduled(A) is None


def test_a_forgotten_run_never_comes_due():
    due = rechecks_queuing_into(set())
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
    queued: set = set()
    due = rechecks_queuing_into(queued, reconcile_interval_seconds=60)
    events = [warning("a-a1-worker-0"), warning("b-a10-worker-0"), warning("b-a10", "FailedCreate")]
    due.warnings["ns"] = WarningsRead(time.monotonic(), events)  # fresh: no API call
    due.watch_warnings(A, "a-a1")
    due.watch_warnings(B, "b-a10")
    due.watch_warnings(("ns", "c"), "c-a1")
    due.warnings_seen[A] = rechecks.fingerprint([events[0]])  # A's reconcile saw them already
    due.warnings_seen[B] = rechecks.fingerprint([events[1]])  # B's saw one of its two
    due.warnings_seen[("ns", "c")] = rechecks.fingerprint([])
    await due.wake_on_warnings()
    assert queued == {B}


class EventsOfOthers:
    """A client whose Warning Events were written by whoever may create Events in the namespace."""

    def __init__(self, events, complete=True):
        self.events, self.complete, self.reads = events, complete, 0

    async def list(self, api_version, kind, namespace, **params):
        assert (api_version, kind, params) == ("v1", "Event", {"most": 2000, "fieldSelector": "type=Warning"})
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
        kept = await state.rechecks.namespace_warnings("ns")
        await state.rechecks.namespace_warnings("ns")  # read again (interval 0): told once while it lasts
    assert kept[0] == {"reason": "R" * 128, "message": "m" * 1024, "involvedObject": {"kind": "Pod", "name": "n" * 253}}
    assert kept[1] == {"reason": None, "message": None, "involvedObject": {"kind": None, "name": None}}
    assert state.kube.reads == 2
    told = [r.getMessage() for r in caplog.records if "more than 2000 Warning Events" in r.getMessage()]
    assert len(told) == 1


@pytest.mark.asyncio
async def test_a_pending_attempt_has_its_warnings_read_once_it_waited_long_enough():
    """Before pending_events_after_seconds: no read, a due time for when it has waited that long; after: the
    namespace's warnings about its job, and the run watched."""
    from datetime import datetime, timedelta, timezone

    now = datetime(2026, 12, 6, 12, 0, tzinfo=timezone.utc)
    reads: list = []

    async def list_warnings(namespace):
        reads.append(namespace)
        return [warning("a-a1-worker-0"), warning("b-a1-worker-0")], True

    due = Rechecks(set().add, list_warnings, Settings(metrics_port=0, pending_events_after_seconds=15), lambda: now)
    status = {"phase": "Pending", "jobName": "a-a1", "attemptStartTime": (now - timedelta(seconds=5)).isoformat()}
    before = time.monotonic()
    assert await due.pending_warnings(A, status) == [] and reads == []
    assert before + 10 <= due.scheduled(A) <= time.monotonic() + 10
    status["attemptStartTime"] = (now - timedelta(seconds=15)).isoformat()
    assert await due.pending_warnings(A, status) == [warning("a-a1-worker-0")] and reads == ["ns"]
    assert due.watching_warnings["ns"] == {A: "a-a1"}
    assert await due.pending_warnings(A, {**status, "phase": "Running"}) == [] and due.watching_warnings["ns"] == {}


@pytest.mark.asyncio
async def test_the_loop_sweeps_every_run_once_it_acts_and_queues_due_ones():
    import asyncio

    queued: list = []
    swept = asyncio.Event()
    acting = False

    def enqueue(key):
        queued.append(key)
        if len(queued) == 3:
            swept.set()

    due = Rechecks(enqueue, no_warnings, Settings(metrics_port=0, reconcile_interval_seconds=0.01), lambda: None)
    due.at(B, 0.0)
    loop = asyncio.create_task(due.run(lambda: acting, lambda: [A, B]))
    try:
        await asyncio.sleep(0.05)  # ticks while not acting
        assert queued == []
        acting = True
        await asyncio.wait_for(swept.wait(), timeout=10)
        assert queued == [A, B, B]  # the sweep on starting to act, then B's due time
    finally:
        loop.cancel()
