"""HTTP/1.1 to one API server: keep-alive connections, Content-Length or chunked answers, every read bounded.

The operator's calls went through aiohttp, whose client spent about 0.2 ms of CPU on each request beyond what the
bytes and TLS cost (0.36-0.48 ms a create against 0.17-0.20 here, 2,000 creates at a real kube-apiserver): with
three writes a run, a sixth of the operator's CPU in a burst. The API server speaks plain HTTP/1.1 and the operator
asks little of it, so this is all it needs: no proxies, cookies, redirects or compression (the server compresses
only when asked, and nothing here asks).

Every error is an OSError, which the operator's callers already handle as "the API server could not be reached":
`ConnectionError` and `ServerDisconnected`, `TimeoutError`, `ssl.SSLError`, `AnswerTooLarge` when an answer is longer
than its reader holds, and `NotHttp` when the server's bytes are not HTTP/1.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass
from typing import AsyncIterator, Optional
from urllib.parse import urlsplit

#: The longest status line and headers read (bytes); also a chunk-size line's bound.
MAX_HEAD_BYTES = 64 << 10
#: Pieces of a body are read at most this long (a chunk may say it is longer).
PIECE_BYTES = 1 << 20
#: Seconds to open a connection (TCP and TLS handshake), and a whole request and its answer at most (aiohttp's
#: defaults, which the operator had).
CONNECT_TIMEOUT_SECONDS = 30.0
REQUEST_TIMEOUT_SECONDS = 300.0
#: Idle connections kept for the next request; more are closed when they come back.
IDLE_CONNECTIONS_MAX = 64
#: Kept connections a request tries (each found closed by the server) before it opens a new one.
STALE_TRIES = 3


class AnswerTooLarge(OSError):
    """The server's answer was longer than its reader would hold."""


class NotHttp(OSError):
    """The server's bytes are not an HTTP/1.1 answer (its status line, a header or the chunked framing)."""


class ServerDisconnected(ConnectionError):
    """The server closed the connection before its answer was complete."""


class _Stale(Exception):
    """A kept connection turned out closed by the server before it answered anything: the request may go again."""


@dataclass
class Answer:
    status: int
    reason: str
    headers: dict[str, str]  # names in lower case
    body: bytes = b""

    @property
    def chunked(self) -> bool:
        return "chunked" in self.headers.get("transfer-encoding", "").lower()


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    def usable(self) -> bool:
        return not (self.reader.at_eof() or self.writer.is_closing())

    def close(self) -> None:
        self.writer.close()

    async def send(self, head: bytes, body: Optional[bytes]) -> None:
        self.writer.write(head + body if body else head)
        await self.writer.drain()

    async def read_head(self) -> Answer:
        try:
            raw = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as error:
            raise ServerDisconnected("the server closed the connection before answering") from error
        except asyncio.LimitOverrunError as error:
            raise AnswerTooLarge(f"the server's headers are longer than {MAX_HEAD_BYTES} bytes") from error
        status_line, *lines = raw[:-4].decode("latin-1").split("\r\n")
        version, _, rest = status_line.partition(" ")
        code, _, reason = rest.partition(" ")
        if not (version.startswith("HTTP/1.") and code.isdigit() and len(code) == 3):
            raise NotHttp(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        headers = {}
        for line in lines:
            name, colon, value = line.partition(":")
            if not colon:
                raise NotHttp(f"not an HTTP header: {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        return Answer(int(code), reason, headers)

    async def body_pieces(self, answer: Answer, read_timeout: Optional[float] = None) -> AsyncIterator[bytes]:
        """The answer's body as it arrives (decoded from chunks), a piece per read of at most PIECE_BYTES, each read
        awaited at most `read_timeout` seconds; to the end of the connection when the server gave no length."""
        if answer.status in (204, 304) or 100 <= answer.status < 200:
            return
        if answer.chunked:
            decoder = ChunkedDecoder()
            while not decoder.done:
                if not (data := await self._read(PIECE_BYTES, read_timeout)):
                    raise ServerDisconnected("the server closed the connection in the middle of its answer")
                if piece := decoder.feed(data):
                    yield piece
        elif (length := answer.headers.get("content-length")) is not None:
            if not (length.isdigit() and len(length) <= 16):
                raise NotHttp(f"Content-Length is not a number: {length[:40]!r}")
            left = int(length)
            while left:
                if not (piece := await self._read(min(left, PIECE_BYTES), read_timeout)):
                    raise ServerDisconnected("the server closed the connection in the middle of its answer")
                left -= len(piece)
                yield piece
        else:
            while piece := await self._read(PIECE_BYTES, read_timeout):
                yield piece

    async def _read(self, most: int, timeout: Optional[float]) -> bytes:
        if timeout is None:
            return await self.reader.read(most)
        async with asyncio.timeout(timeout):
            return await self.reader.read(most)


class ChunkedDecoder:
    """`Transfer-Encoding: chunked`, decoded from whatever pieces the bytes arrive in: each read's whole chunks in one
    call, where a read per chunk took three awaits (a burst's watch brings hundreds of one-event chunks at once)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._left = 0  # bytes of the current chunk's data still to come
        self._state = "size"  # or "data", "crlf" (after a chunk's data), "trailer"
        self.done = False

    def feed(self, data: bytes) -> bytes:
        """The body bytes `data` completes; NotHttp when the framing is not chunked encoding."""
        if self.done:
            raise NotHttp("bytes after the end of a chunked answer")
        buffer, at, out = self._buffer, 0, []
        buffer += data
        while not self.done:
            if self._state == "data":
                take = min(self._left, len(buffer) - at)
                if not take:
                    break
                out.append(bytes(buffer[at : at + take]))
                at, self._left = at + take, self._left - take
                if not self._left:
                    self._state = "crlf"
            elif self._state == "crlf":
                if len(buffer) - at < 2:
                    break
                if buffer[at : at + 2] != b"\r\n":
                    raise NotHttp("a chunk's data does not end with CRLF")
                at, self._state = at + 2, "size"
            else:
                end = buffer.find(b"\r\n", at)
                if end < 0:
                    if len(buffer) - at > MAX_HEAD_BYTES:
                        raise NotHttp(f"a chunk-size or trailer line longer than {MAX_HEAD_BYTES} bytes")
                    break
                line, at = bytes(buffer[at:end]), end + 2
                if self._state == "trailer":
                    self.done = not line
                elif size := _chunk_size(line):
                    self._left, self._state = size, "data"
                else:
                    self._state = "trailer"
        if self.done and at < len(buffer):
            raise NotHttp("bytes after the end of a chunked answer")
        del buffer[:at]
        return b"".join(out) if len(out) != 1 else out[0]


def _chunk_size(line: bytes) -> int:
    digits = line.split(b";", 1)[0].strip()
    if not digits or len(digits) > 16 or digits.strip(b"0123456789abcdefABCDEF"):
        raise NotHttp(f"not a chunk size: {line[:40]!r}")
    return int(digits, 16)


def _keeps_alive(answer: Answer) -> bool:
    return "close" not in answer.headers.get("connection", "").lower() and (
        answer.chunked or "content-length" in answer.headers
    )


class Http:
    """Requests to `server` (`https://host:port[/prefix]` or http://), with `headers` on every one."""

    def __init__(self, server: str, headers: dict[str, str], ssl_context: Optional[ssl.SSLContext]):
        url = urlsplit(server)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"the API server's address must be http(s)://host[:port]: {server!r}")
        self.host, self.prefix = url.hostname, url.path.rstrip("/")
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl = (ssl_context or ssl.create_default_context()) if url.scheme == "https" else None
        fixed = "".join(f"{name}: {value}\r\n" for name, value in {"Host": url.netloc, **headers}.items())
        self._fixed = fixed.encode("latin-1")
        self._idle: list[_Connection] = []

    async def _connect(self) -> _Connection:
        async with asyncio.timeout(CONNECT_TIMEOUT_SECONDS):
            reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=MAX_HEAD_BYTES)
        return _Connection(reader, writer)

    def _head(self, method: str, path: str, headers: dict[str, str], body: Optional[bytes]) -> bytes:
        if any(c in path for c in " \r\n"):
            raise ValueError(f"a request path with a space or line break: {path[:80]!r}")
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        length = f"Content-Length: {len(body)}\r\n" if body is not None else ""
        request_line = f"{method} {self.prefix}{path} HTTP/1.1\r\n"
        return request_line.encode("latin-1") + self._fixed + f"{extra}{length}\r\n".encode("latin-1")

    async def request(
        self, method: str, path: str, headers: dict[str, str], body: Optional[bytes], max_bytes: int
    ) -> Answer:
        """One request and its whole answer (`AnswerTooLarge` past `max_bytes`). A kept connection the server closed
        while it was idle is found out before anything was answered, and the request goes once more on a new one: a
        create the server did take before closing then answers 409, which the operator reads as "already there"."""
        head = self._head(method, path, headers, body)
        async with asyncio.timeout(REQUEST_TIMEOUT_SECONDS):
            for _ in range(STALE_TRIES):
                if not self._idle:
                    break
                connection = self._idle.pop()
                if not connection.usable():
                    connection.close()
                    continue
                try:
                    return await self._exchange(connection, head, body, max_bytes, reused=True)
                except _Stale:
                    continue
            return await self._exchange(await self._connect(), head, body, max_bytes, reused=False)

    async def _exchange(
        self, connection: _Connection, head: bytes, body: Optional[bytes], max_bytes: int, reused: bool
    ) -> Answer:
        """`_Stale` when a `reused` connection fails before any answer began; once the server has begun to answer,
        a failure is the caller's (the request is never sent again)."""
        kept = False
        try:
            try:
                await connection.send(head, body)
                answer = await connection.read_head()
            except (ServerDisconnected, ConnectionResetError, BrokenPipeError) as error:
                if reused:
                    raise _Stale from error
                raise
            pieces, size = [], 0
            async for piece in connection.body_pieces(answer):
                size += len(piece)
                if size > max_bytes:
                    raise AnswerTooLarge(f"the answer is longer than {max_bytes} bytes")
                pieces.append(piece)
            answer.body = b"".join(pieces)
            kept = _keeps_alive(answer)
            return answer
        finally:  # a connection left in the middle of an answer (an error, a cancellation) is never used again
            if kept and len(self._idle) < IDLE_CONNECTIONS_MAX:
                self._idle.append(connection)
            else:
                connection.close()

    @contextlib.asynccontextmanager
    async def stream(
        self, path: str, headers: dict[str, str], read_timeout: float
    ) -> AsyncIterator[tuple[Answer, AsyncIterator[bytes]]]:
        """A GET whose answer is read as it comes (a watch), on a connection of its own, closed at the end: the
        answer's status and headers, and its body's pieces, each awaited at most `read_timeout` seconds."""
        connection = await self._connect()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_SECONDS):
                await connection.send(self._head("GET", path, headers, None), None)
                answer = await connection.read_head()

            yield answer, connection.body_pieces(answer, read_timeout)
        finally:
            connection.close()

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
