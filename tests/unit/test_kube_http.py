"""The operator's HTTP/1.1 client against a loopback server that answers byte for byte what each test scripts:
chunked framing however it is split, keep-alive and the server closing an idle connection, and every bound."""

import asyncio

import pytest

from trainingrun_operator.kube_http import (
    AnswerTooLarge,
    ChunkedDecoder,
    Http,
    NotHttp,
    ServerDisconnected,
)


def chunked(*pieces: bytes, trailer: bytes = b"") -> bytes:
    return b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n" + trailer + b"\r\n"


def test_a_chunked_body_decodes_the_same_however_the_bytes_are_split():
    body = [b'{"type":"ADDED"}\n', b"x" * 300, b"\r\n inside data \r\n", b"y"]
    wire = chunked(*body, trailer=b"X-Trailer: 1\r\n")
    for cut in range(len(wire) + 1):
        for step in (1, 7, len(wire)):
            decoder, out = ChunkedDecoder(), b""
            for part in [wire[:cut]] + [wire[i : i + step] for i in range(cut, len(wire), step)]:
                out += decoder.feed(part)
            assert decoder.done and out == b"".join(body), (cut, step)


@pytest.mark.parametrize(
    "wire, why",
    [
        (b"zz\r\n", "not a chunk size"),
        (b"3\r\nabcX\r\n", "does not end with CRLF"),
        (b"1" * 17 + b"\r\n", "not a chunk size"),  # more than 64 bits
        (b"1" * (70 << 10), "longer than"),  # a size line without end
        (chunked(b"a") + b"more", "after the end"),
    ],
)
def test_chunked_framing_that_is_not_chunked_encoding_is_refused(wire, why):
    with pytest.raises(NotHttp, match=why):
        ChunkedDecoder().feed(wire)


class Scripted:
    """A loopback HTTP server: each request read is answered with the next scripted bytes; after an answer whose
    script entry ends in None the connection is closed, after the last one it is held open. Counts connections and
    requests."""

    def __init__(self, *answers):
        self.answers, self.connections, self.requests = list(answers), 0, []

    async def __aenter__(self):
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.http = Http(f"http://127.0.0.1:{port}/prefix", {"Authorization": "Bearer t"}, None)
        return self

    async def __aexit__(self, *exc):
        self.http.close()
        self.server.close()
        await self.server.wait_closed()

    async def serve(self, reader, writer):
        self.connections += 1
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                self.requests.append(head + await reader.readexactly(length))
                answer = self.answers.pop(0)
                for part in answer if isinstance(answer, tuple) else (answer,):
                    if part is None:
                        return
                    writer.write(part)
                    await writer.drain()
            await reader.read()  # held open until the client closes it
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


@pytest.mark.asyncio
async def test_requests_reuse_one_connection_and_carry_the_fixed_headers():
    chunked_answer = b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(b'{"a":', b"1}")
    async with Scripted(ok(b"{}"), chunked_answer, b"HTTP/1.1 204 No Content\r\n\r\n") as s:
        first = await s.http.request("GET", "/api/v1/pods", {}, None, 100)
        second = await s.http.request("POST", "/api/v1/pods", {"Content-Type": "application/json"}, b'{"x":1}', 100)
        third = await s.http.request("DELETE", "/api/v1/pods/p", {}, None, 100)
    assert (first.status, first.body) == (200, b"{}")
    assert (second.status, second.reason, second.body) == (201, "Created", b'{"a":1}')
    assert (third.status, third.body) == (204, b"")
    assert s.connections == 1
    post = s.requests[1]
    assert post.startswith(b"POST /prefix/api/v1/pods HTTP/1.1\r\n") and post.endswith(b'\r\n\r\n{"x":1}')
    assert b"Authorization: Bearer t\r\n" in post and b"Content-Length: 7\r\n" in post


@pytest.mark.asyncio
async def test_a_connection_the_server_closed_while_idle_is_replaced_and_the_request_sent_once_more():
    # The first answer's connection is closed by the server right after it (an idle timeout); the client only finds
    # out when it sends the next request on it.
    async with Scripted((ok(b"1"), None), ok(b"2")) as s:
        assert (await s.http.request("GET", "/a", {}, None, 100)).body == b"1"
        await asyncio.sleep(0)  # the server's close arrives (not needed for the result: a refused send is retried too)
        assert (await s.http.request("GET", "/b", {}, None, 100)).body == b"2"
    assert s.connections == 2 and len(s.requests) == 2


@pytest.mark.asyncio
async def test_an_answer_cut_off_in_its_body_is_an_error_and_is_not_sent_again():
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345"
    async with Scripted((cut, None), ok(b"never")) as s:
        with pytest.raises(ServerDisconnected):
            await s.http.request("POST", "/a", {}, b"{}", 100)
    assert len(s.requests) == 1


@pytest.mark.asyncio
async def test_answers_longer_than_their_bound_are_not_read_and_their_connection_is_closed():
    long_headers = b"HTTP/1.1 200 OK\r\nX-Pad: " + b"p" * (70 << 10) + b"\r\nContent-Length: 0\r\n\r\n"
    async with Scripted(ok(b"x" * 101), long_headers, ok(b"fits")) as s:
        with pytest.raises(AnswerTooLarge, match="longer than 100 bytes"):
            await s.http.request("GET", "/a", {}, None, 100)
        with pytest.raises(AnswerTooLarge, match="headers are longer"):
            await s.http.request("GET", "/b", {}, None, 100)
        assert (await s.http.request("GET", "/c", {}, None, 100)).body == b"fits"
    assert s.connections == 3


@pytest.mark.asyncio
async def test_an_answer_without_a_length_is_read_to_the_close_and_its_connection_not_kept():
    async with Scripted((b"HTTP/1.0 200 OK\r\n\r\nuntil close", None), ok(b"next")) as s:
        assert (await s.http.request("GET", "/a", {}, None, 100)).body == b"until close"
        assert (await s.http.request("GET", "/b", {}, None, 100)).body == b"next"
    assert s.connections == 2


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "answer, error",
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "not an HTTP header"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "Content-Length is not a number"),
    ],
)
async def test_bytes_that_are_not_http_are_refused(answer, error):
    async with Scripted(answer) as s:
        with pytest.raises(NotHttp, match=error):
            await s.http.request("GET", "/a", {}, None, 100)


@pytest.mark.asyncio
async def test_a_path_with_a_line_break_is_never_sent():
    async with Scripted(ok(b"")) as s:
        with pytest.raises(ValueError, match="line break"):
            await s.http.request("GET", "/a\r\nX-Injected: 1", {}, None, 100)
    assert s.requests == []


@pytest.mark.asyncio
async def test_a_stream_yields_pieces_as_they_come_and_times_out_when_nothing_does():
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    async with Scripted((head + b"6\r\nevent1\r\n", b"6\r\nevent2\r\n")) as s:
        async with s.http.stream("/watch", {}, read_timeout=0.5) as (answer, pieces):
            assert answer.status == 200
            got = []
            with pytest.raises(TimeoutError):
                async for piece in pieces:
                    got.append(piece)
    assert b"".join(got) == b"event1event2"
