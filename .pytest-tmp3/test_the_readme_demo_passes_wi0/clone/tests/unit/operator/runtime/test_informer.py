"""informer.py: a list, then watches from the last resourceVersion seen; a 410 lists again and tells what went."""

from __future__ import annotations

import asyncio
from urllib.parse import parse_qs, urlsplit

import pytest

from trainingrun_operator.runtime.informer import Index, Informer
from trainingrun_operator.runtime.kube import WatchGone


def obj(name, uid, version, **labels):
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid, "resourceVersion": version, "labels": labels}}


class Server:
    """Answers an informer's lists and watches from scripts; records the resourceVersions it was asked to watch from."""

    def __init__(self, lists, watches):
        self.lists, self.watches, self.watched_from = list(lists), list(watches), []
        self.held, self.idle = asyncio.Event(), asyncio.Event()  # the last watch stays open until the test ends

    async def request(self, method, path, max_bytes=None):
        assert method == "GET" and max_bytes
        return self.lists.pop(0)

    async def watch(self, path):
        self.watched_from.append(parse_qs(urlsplit(path).query)["resourceVersion"][0])
        if not self.watches:
            self.idle.set()
            await self.held.wait()
            return
        script = self.watches.pop(0)
        if isinstance(script, Exception):
            raise script
        for event in script:
            yield event


@pytest.mark.asyncio
async def test_a_watch_resumes_from_the_last_version_and_a_410_lists_again_telling_what_went():
    a, b = obj("a", "u-a", "10", run="r"), obj("b", "u-b", "10", run="r")
    server = Server(
        lists=[
            {"metadata": {"resourceVersion": "10"}, "items": [a, b]},
            {"metadata": {"resourceVersion": "20"}, "items": [obj("a", "u-a", "20", run="r")]},
        ],
        watches=[
            [
                {"type": "MODIFIED", "object": obj("a", "u-a", "11", run="r")},
                {"type": "BOOKMARK", "object": obj("", "", "12")},
            ],
            WatchGone("/apis/x"),
        ],
    )
    told = []
    informer = Informer(lambda: server, "/apis/x", lambda type_, body: told.append((type_, body["metadata"]["name"])))
    listed = asyncio.Event()
    task = asyncio.create_task(informer.run(listed))
    try:
        await asyncio.wait_for(listed.wait(), 10)
        await asyncio.wait_for(server.idle.wait(), 10)  # the watch after the relist
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert server.watched_from == ["10", "12", "20"]  # after the bookmark, then from the new list
    assert told == [("ADDED", "a"), ("ADDED", "b"), ("MODIFIED", "a"), ("MODIFIED", "a"), ("DELETED", "b")]
    assert list(informer.known) == ["u-a"]


def test_an_index_keeps_each_runs_objects_by_name_and_forgets_them():
    index = Index()
    index.put(("ns", "r"), "a", {"n": 1})
    index.put(("ns", "r"), "b", {"n": 2})
    index.put(("ns", "r"), "a", {"n": 3})
    assert index.get(("ns", "r")) == [{"n": 3}, {"n": 2}] and index.get(("ns", "other")) == []
    index.put(("ns", "r"), "a", None)
    index.put(("ns", "r"), "b", None)
    index.put(("ns", "gone"), "x", None)
    assert index == {}
