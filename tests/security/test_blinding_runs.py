"""One tenant's TrainingRun must never blind the operator for every namespace (issue 77, item 1).

On main a run whose `initArgs` nested a few hundred levels (which the real API server stores) ended the informer task
when the operator re-serialised it, and one nested past orjson's parser (1024) made every list page holding it
unreadable, for ever; the liveness probe stayed green meanwhile. The real API server case is
tests/real_api/test_hostile_runs_real.py; here each piece on its own.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from operator_harness import JOBS, Cluster, declare_resources, eventually, operator, training_run
from trainingrun_operator import handlers, indexes
from trainingrun_operator.runtime import informer as informer_module
from trainingrun_operator.runtime import kube
from trainingrun_operator.runtime.informer import Informer
from trainingrun_operator.settings import Settings
from trainingrun_operator.state import OperatorState


def nested_json(depth: int) -> bytes:
    return b'{"a":' * depth + b'{"leaf":1}' + b"}" * depth


def run_text(name: str, init_args: bytes) -> bytes:
    return (
        b'{"apiVersion":"trainingrun.dev/v1alpha1","kind":"TrainingRun","metadata":{"name":"'
        + name.encode()
        + b'","namespace":"ns","uid":"u-'
        + name.encode()
        + b'","generation":1},"spec":{"checkpoint":{"uri":"s3://b/x"},"trainer":{"model":{"classPath":'
        + b'"trainingrun_trainer.models.CharTransformer","initArgs":'
        + init_args
        + b"}}}}"
    )


@pytest.mark.parametrize("depth", [300, 2_000, 200_000])
def test_a_list_page_with_a_run_nested_past_any_parser_is_read_and_the_run_refused(depth):
    """On main: orjson's 'depth limit exceeded' for the whole page (past 1024), or a TypeError re-serialising the run
    for the index (past 254)."""
    page = b'{"metadata":{"resourceVersion":"7"},"items":[' + run_text("deep", nested_json(depth)) + b","
    page += run_text("normal", b'{"dim":64}') + b"]}"
    items = kube._decoded(page)["items"]
    deep, normal = (indexes.slim_run(item) for item in items)
    assert indexes.spec_problem(normal) is None
    assert orjson.loads(normal[indexes.SPEC_JSON])["trainer"]["model"]["initArgs"] == {"dim": 64}
    problem = indexes.spec_problem(deep)
    assert (
        problem
        == "spec.trainer.model.initArgs: nests deeper than 16 levels; flatten it, or pass a file the class reads"
    )


def test_a_watch_line_nested_past_the_parser_is_an_event_not_a_dead_watch():
    line = b'{"type":"ADDED","object":' + run_text("deep", nested_json(5_000)) + b"}"
    event = kube._decoded(line)
    assert event["type"] == "ADDED" and event["object"]["metadata"]["name"] == "deep"


class Server:
    """An informer's API: lists and watches from scripts; the last watch stays open until the test ends."""

    def __init__(self, lists, watches):
        self.lists, self.watches = list(lists), list(watches)
        self.held, self.idle, self.watched = asyncio.Event(), asyncio.Event(), 0

    async def request(self, method, path, max_bytes=None):
        return self.lists.pop(0)

    async def watch(self, path):
        self.watched += 1
        if not self.watches:
            self.idle.set()
            await self.held.wait()
            return
        script = self.watches.pop(0)
        if isinstance(script, BaseException):
            raise script
        for event in script:
            yield event


def obj(name, version="1"):
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}", "resourceVersion": version}}


async def run_until_idle(informer, server):
    listed = asyncio.Event()
    task = asyncio.create_task(informer.run(listed))
    try:
        await asyncio.wait_for(server.idle.wait(), 10)
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.asyncio
async def test_an_object_whose_handling_raises_is_skipped_and_the_watch_goes_on():
    """On main the exception ended the informer's task, and with it (gathered) every other watch."""
    server = Server(
        lists=[{"metadata": {"resourceVersion": "1"}, "items": [obj("poison"), obj("a")]}],
        watches=[[{"type": "MODIFIED", "object": obj("poison", "2")}, {"type": "ADDED", "object": obj("b", "3")}]],
    )
    told, skipped = [], []

    def on_event(type_, body):
        if body["metadata"]["name"] == "poison":
            raise TypeError("Recursion limit reached")
        told.append((type_, body["metadata"]["name"]))

    informer = Informer(lambda: server, "/apis/x", on_event, on_skipped=lambda body, e: skipped.append(body))
    await run_until_idle(informer, server)
    assert told == [("ADDED", "a"), ("ADDED", "b")]
    assert [body["metadata"]["resourceVersion"] for body in skipped] == ["1", "2"]


@pytest.mark.asyncio
async def test_a_watch_that_fails_with_any_exception_lists_and_watches_again(monkeypatch):
    """On main only ApiError, OSError and ValueError were retried: anything else ended the task for good."""
    monkeypatch.setattr(informer_module, "BACKOFF_SECONDS", 0.01)
    server = Server(
        lists=[
            {"metadata": {"resourceVersion": "1"}, "items": []},
            {"metadata": {"resourceVersion": "2"}, "items": []},
        ],
        watches=[TypeError("a bug about one page")],
    )
    await run_until_idle(Informer(lambda: server, "/apis/x", lambda *_: None), server)
    assert server.watched == 2 and not server.lists


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.mark.asyncio
async def test_the_operator_is_blind_when_a_watch_ended_or_has_not_been_answered_for_two_periods():
    clock = Clock()
    state = OperatorState(Settings())
    heard = Informer(lambda: None, "/apis/runs", lambda *_: None, clock=clock)
    failing = Informer(lambda: None, "/api/v1/pods", lambda *_: None, clock=clock)
    alive = asyncio.create_task(asyncio.Event().wait())
    ended = asyncio.create_task(asyncio.sleep(0))
    await asyncio.sleep(0.01)
    try:
        state.watches = [(heard, alive), (failing, alive)]
        assert state.blind_watches() == []
        clock.now += informer_module.BLIND_AFTER_SECONDS + 1
        heard.heard_at = clock.now - 5  # its watch told an event or a bookmark; the other kept failing
        assert state.blind_watches() == [
            f"no answer to the watch of /api/v1/pods for {informer_module.BLIND_AFTER_SECONDS + 1} s"
        ]
        state.watches = [(heard, ended)]
        assert state.blind_watches() == ["the watch of /apis/runs ended"]
    finally:
        alive.cancel()


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_run_the_operator_cannot_read_is_refused_and_the_others_go_on(kmock, monkeypatch):
    """Whatever raises about one run (here slim_run, made to fail for it): the run is named in a condition and never
    run, the next run gets its attempt."""
    declare_resources(kmock)
    cluster = Cluster(kmock)
    real_slim_run = handlers.slim_run

    def failing_for_poison(body, before=None):
        if body["metadata"]["name"] == "poison":
            raise RecursionError("maximum recursion depth exceeded")
        return real_slim_run(body, before)

    monkeypatch.setattr(handlers, "slim_run", failing_for_poison)
    async with operator(kmock) as state:
        await cluster.create_run(training_run("poison", uid="0000-poison"))
        await cluster.create_run(training_run("demo"))
        await eventually(lambda: cluster.job("demo-a1"), what="the other run's attempt")
        condition = await eventually(
            lambda: next(
                (c for c in cluster.status("poison").get("conditions", []) if c["type"] == "SpecRejected"), None
            )
        )
        assert "could not read this run (RecursionError)" in condition["message"]
        assert cluster.obj(JOBS, "poison-a1") is None
        assert state.metrics.objects_skipped.labels("TrainingRun")._value.get() >= 1
