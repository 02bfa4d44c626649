"""API paths for the kinds the operator writes, and the order its requests go out in."""

import pytest

from trainingrun_operator.runtime.kube import collection_path, object_path


def test_paths():
    assert collection_path("v1", "ConfigMap", "ns") == "/api/v1/namespaces/ns/configmaps"
    assert collection_path("kubeflow.org/v1", "PyTorchJob", "ns") == "/apis/kubeflow.org/v1/namespaces/ns/pytorchjobs"
    assert (
        object_path("trainingrun.dev/v1alpha1", "TrainingRun", "ns", "demo", "status")
        == "/apis/trainingrun.dev/v1alpha1/namespaces/ns/trainingruns/demo/status"
    )
    assert (
        object_path("rbac.authorization.k8s.io/v1", "Role", "ns", "r")
        == "/apis/rbac.authorization.k8s.io/v1/namespaces/ns/roles/r"
    )


@pytest.mark.asyncio
async def test_the_gate_lets_waiters_in_by_priority_then_in_order():
    """Children of new attempts before status writes before Events, whatever order they asked in."""
    import asyncio

    from trainingrun_operator.runtime.kube import ACT, EVENT, STATUS, PriorityGate

    gate = PriorityGate(1)
    await gate(ACT)  # the one place is taken
    order = []

    async def wait(label, priority):
        await gate(priority)
        order.append(label)
        gate.release()

    waiters = [
        asyncio.create_task(wait(label, priority))
        for label, priority in (("event", EVENT), ("status 1", STATUS), ("child", ACT), ("status 2", STATUS))
    ]
    await asyncio.sleep(0)  # all four are waiting
    assert order == [] and gate.holders == 1
    gate.release()
    await asyncio.gather(*waiters)
    assert order == ["child", "status 1", "status 2", "event"]
    assert gate.holders == 0


@pytest.mark.asyncio
async def test_a_cancelled_waiter_gives_its_place_back():
    import asyncio

    from trainingrun_operator.runtime.kube import ACT, PriorityGate

    gate = PriorityGate(1)
    await gate(ACT)
    cancelled = asyncio.create_task(gate(ACT))
    await asyncio.sleep(0)
    cancelled.cancel()
    gate.release()  # would hand the place to the cancelled waiter
    await asyncio.gather(cancelled, return_exceptions=True)
    assert gate.holders == 0
    await asyncio.wait_for(gate(ACT), 1)  # the place is free
    assert gate.holders == 1


@pytest.mark.asyncio
async def test_a_list_answered_with_empty_pages_stops_after_a_bounded_number_of_requests():
    """The API may answer a page with no items and a continue token (a field selector applied after the page was
    read); a namespace full of Events must not cost a request per page without bound."""
    from trainingrun_operator.runtime.kube import Kube

    class EmptyPages(Kube):
        def __init__(self):
            self.asked: list[str] = []

        async def request(self, method, path, body=None, **kwargs):
            self.asked.append(path)
            return {"items": [], "metadata": {"continue": f"token-{len(self.asked)}"}}

    kube = EmptyPages()
    assert await kube.list("v1", "Event", "ns", fieldSelector="type=Warning") == ([], False)
    assert len(kube.asked) == 16  # four times the 4 pages of 500 that most=2000 fills
    assert "continue=token-15" in kube.asked[-1]
    kube.asked.clear()
    assert await kube.list("v1", "Event", "ns", pages=2) == ([], False) and len(kube.asked) == 2


def pods(namespace="ns"):
    return f"/api/v1/namespaces/{namespace}/pods"


async def watched(kmock, namespace="ns", **kwargs):
    """The events of one watch of the pods in `namespace` through `Kube.watch` against kmock, and what ended it."""
    import kopf

    from trainingrun_operator.runtime.kube import Kube

    kube, events = Kube(kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"), insecure=True)), []
    try:
        async for event in kube.watch(f"{pods(namespace)}?watch=true&resourceVersion=7", **kwargs):
            events.append(event)
    except Exception as error:  # what ended the watch is the result
        return events, error
    finally:
        await kube.close()
    return events, None


def pod_event(type_, name):
    return {"type": type_, "object": {"kind": "Pod", "metadata": {"name": name, "resourceVersion": "8"}}}


@pytest.mark.asyncio
async def test_a_watch_answered_410_is_gone(kmock):
    """A resourceVersion older than the server keeps: the informer must list again, not back off and retry it."""
    from trainingrun_operator.runtime.kube import WatchGone

    kmock[f"get {pods()}"] << 410 << {"kind": "Status", "code": 410, "reason": "Expired"}
    events, ended = await watched(kmock)
    assert events == [] and isinstance(ended, WatchGone)


@pytest.mark.asyncio
async def test_a_410_error_event_in_the_stream_is_gone_after_the_events_before_it(kmock):
    """The API server answers an expired watch 200 and then streams an ERROR event with code 410."""
    from trainingrun_operator.runtime.kube import WatchGone

    gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}}
    kmock[f"get {pods()}"] << (pod_event("ADDED", "a"), pod_event("MODIFIED", "a"), gone, pod_event("ADDED", "b"))
    events, ended = await watched(kmock)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "a"), ("MODIFIED", "a")]
    assert isinstance(ended, WatchGone)


@pytest.mark.asyncio
async def test_other_error_events_pass_and_refusals_and_long_lines_end_the_watch(kmock):
    """An ERROR with another code is the informer's to raise (it backs off); a 403 is an ApiError; a line longer than
    the cap is refused before it is parsed, however the server splits it."""
    from trainingrun_operator.runtime.kube import ApiError

    forbidden = {"type": "ERROR", "object": {"kind": "Status", "code": 500, "reason": "InternalError"}}
    kmock[f"get {pods('erring')}"] << (pod_event("ADDED", "a"), forbidden)
    kmock[f"get {pods('forbidden')}"] << 403 << {"kind": "Status", "code": 403, "reason": "Forbidden"}
    long_line = (pod_event("ADDED", "a"), b'{"type": "ADDED", "object": {"x": "', b"y" * 5000)
    kmock[f"get {pods('long')}"] << long_line

    events, ended = await watched(kmock, "erring")
    assert [e["type"] for e in events] == ["ADDED", "ERROR"] and ended is None
    events, ended = await watched(kmock, "forbidden")
    assert events == [] and isinstance(ended, ApiError) and ended.status == 403
    events, ended = await watched(kmock, "long", max_line_bytes=4096)
    assert [e["type"] for e in events] == ["ADDED"]
    assert isinstance(ended, ValueError) and "longer than 4096 bytes" in str(ended)


# ---------------------------------------------------------------------------------------- the wire (a scripted server)


@pytest.mark.asyncio
async def test_requests_reuse_one_connection_and_carry_the_credentials():
    from scripted_api import Scripted, chunked, ok

    chunked_answer = b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(b'{"a":', b"1}")
    async with Scripted(ok(b'{"b": 2}'), chunked_answer, b"HTTP/1.1 204 No Content\r\n\r\n") as s:
        assert await s.kube.request("GET", "/api/v1/pods") == {"b": 2}
        assert await s.kube.request("POST", "/api/v1/pods", {"x": 1}) == {"a": 1}
        assert await s.kube.request("DELETE", "/api/v1/pods/p") == {}
    assert s.connections == 1
    post = s.requests[1]
    assert post.startswith(b"POST /prefix/api/v1/pods HTTP/1.1\r\n") and post.endswith(b'\r\n\r\n{"x":1}')
    assert b"Authorization: Bearer t\r\n" in post and b"Content-Type: application/json\r\n" in post


@pytest.mark.asyncio
async def test_a_connection_the_server_closed_while_idle_is_replaced():
    from scripted_api import Scripted, ok

    async with Scripted((ok(b"1"), None), ok(b"2")) as s:
        assert await s.kube.request("GET", "/a") == 1
        assert await s.kube.request("GET", "/b") == 2
    assert s.connections == 2 and len(s.requests) == 2


@pytest.mark.asyncio
async def test_an_answer_cut_off_in_its_body_is_unreachable_and_not_sent_again():
    from scripted_api import Scripted, ok
    from trainingrun_operator.runtime.kube import ApiUnreachable

    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345"
    async with Scripted((cut, None), ok(b"9")) as s:
        with pytest.raises(ApiUnreachable):
            await s.kube.request("POST", "/a", {})
    assert len(s.requests) == 1


@pytest.mark.asyncio
async def test_answers_longer_than_their_bound_are_refused_and_the_next_answer_is_its_own():
    from scripted_api import Scripted, ok
    from trainingrun_operator.runtime.kube import AnswerTooLarge

    long_headers = b"HTTP/1.1 200 OK\r\nX-Pad: " + b"p" * (70 << 10) + b"\r\nContent-Length: 0\r\n\r\n"
    async with Scripted(ok(b"1" * 101), long_headers, ok(b"3")) as s:
        with pytest.raises(AnswerTooLarge, match="GET /a: the answer is longer than 100 bytes"):
            await s.kube.request("GET", "/a", max_bytes=100)
        with pytest.raises(OSError, match="GET /b"):
            await s.kube.request("GET", "/b")
        assert await s.kube.request("GET", "/c") == 3
    assert s.connections >= 2  # the cut-off answer's connection was closed, not read on


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "answer",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    ],
    ids=["ssh", "no-colon", "negative-length"],
)
async def test_bytes_that_are_not_http_are_an_oserror(answer):
    from scripted_api import Scripted

    async with Scripted(answer) as s:
        with pytest.raises(OSError, match="GET /a"):
            await s.kube.request("GET", "/a")


@pytest.mark.asyncio
async def test_throttled_requests_are_retried_after_retry_after_and_counted():
    from scripted_api import Scripted, ok

    throttled = b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 0\r\nContent-Length: 2\r\n\r\n{}"
    errors = []
    async with Scripted(throttled, throttled, ok(b"7"), on_error=errors.append) as s:
        assert await s.kube.request("GET", "/a") == 7
    assert errors == [429, 429] and len(s.requests) == 3
