"""How many connections the report endpoint (reports.py) holds and for how long: the limits (`ReportLimits`), and
what enforces them below aiohttp, one `_Guard` per connection. aiohttp's server alone waits for a request head for an
hour and admits any number of connections; these share the operator's event loop and file descriptors with its API
connections, and anyone in the cluster can open them."""

from __future__ import annotations

import asyncio
import collections
import ssl
from dataclasses import dataclass
from typing import Callable, Optional, cast

from aiohttp import web

from trainingrun_api import progress_report


@dataclass(frozen=True)
class ReportLimits:
    """What the report endpoint allows a connection, so that clients who are slow on purpose (or broken) cannot hold
    its connections, file descriptors and event loop, which it shares with the operator's API calls. Rank 0 of each
    run sends a report of at most MAX_REPORT_BYTES every few seconds, each on a connection of its own (urllib)."""

    #: A connection must bring a whole request head within this many seconds of opening (the TLS handshake too) or
    #: of its last answer, or it is closed: idle kept connections, clients that send nothing, heads a byte a second.
    idle_timeout_seconds: float = 10.0
    #: A body must arrive at this rate at least (after the head; `idle_timeout_seconds` of grace), else the report
    #: is answered 408 and the connection closed: 64 KiB, the largest report, then has 74 s at most.
    body_min_bytes_per_second: float = 1024.0
    #: Connections open at once; more are answered 503 and closed at once.
    max_connections: int = 512
    #: Connections open at once from one source address (a pod reports over one).
    max_connections_per_address: int = 32

    def body_seconds(self, length: Optional[int]) -> float:
        return self.idle_timeout_seconds + (length or progress_report.MAX_REPORT_BYTES) / self.body_min_bytes_per_second


#: Why the endpoint closed a connection itself (`on_closed`, the metric trainingrun_operator_report_connections_closed).
CLOSED_REASONS = ("max_connections", "max_connections_per_address", "slow_body", "no_request")


class _Guard(asyncio.Protocol):
    """Stands between the event loop and aiohttp's protocol for one connection: counts connections (and per source
    address), refusing those over the caps with a 503 before aiohttp sees them, and tells which closed without ever
    bringing a whole request head (aiohttp's keep-alive timer, `idle_timeout_seconds`, closes those)."""

    def __init__(self, inner: asyncio.Protocol, guard: "ConnectionGuard"):
        self.inner, self.guard = inner, guard
        self.address: Optional[str] = None
        self.counted = self.refused = False
        self.head: Optional[bytearray] = bytearray()  #: bytes until the first head ends (None once it has)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        refusal = self.guard.admit(self.address)
        if refusal:
            self.refused = True
            self.guard.on_closed(refusal)
            body = b'{"message": "too many connections to the report endpoint; send the report again later"}'
            cast(asyncio.WriteTransport, transport).write(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            transport.close()
            return
        self.counted = True
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self.head is not None:
            seen = len(self.head)
            self.head += data[: MAX_HEAD_SCAN - seen]
            # Only the new bytes and the three before them: a head sent a byte at a time costs linear time.
            if self.head.find(b"\r\n\r\n", max(0, seen - 3)) >= 0 or len(self.head) >= MAX_HEAD_SCAN:
                self.head = None  # a whole head (or more than aiohttp would take, which it answers itself)
        self.inner.data_received(data)

    def eof_received(self) -> Optional[bool]:
        return None if self.refused else self.inner.eof_received()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if not self.counted:
            return
        self.guard.release(self.address or "")
        if self.head is not None:
            self.guard.on_closed("no_request")
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.counted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.counted:
            self.inner.resume_writing()


#: Bytes of a connection's first request scanned for the end of its head (aiohttp refuses longer heads itself).
MAX_HEAD_SCAN = 64 << 10


class ConnectionGuard:
    """The counts behind `_Guard`: connections open, in all and per source address."""

    def __init__(self, limits: ReportLimits, on_closed: Callable[[str], None] = lambda reason: None):
        self.limits, self.on_closed = limits, on_closed
        self.open = 0
        self.per_address: collections.Counter[str] = collections.Counter()

    def admit(self, address: str) -> Optional[str]:
        """None when a connection from `address` may open (and it is counted), else why not."""
        if self.open >= self.limits.max_connections:
            return "max_connections"
        if self.per_address[address] >= self.limits.max_connections_per_address:
            return "max_connections_per_address"
        self.open += 1
        self.per_address[address] += 1
        return None

    def release(self, address: str) -> None:
        self.open -= 1
        self.per_address[address] -= 1
        if not self.per_address[address]:
            del self.per_address[address]


class GuardedSite(web.BaseSite):
    """aiohttp's TCPSite, with each connection behind a `_Guard` and the TLS handshake bounded like a request head."""

    def __init__(self, runner: web.AppRunner, port: int, ssl_context: Optional[ssl.SSLContext], guard: ConnectionGuard):
        super().__init__(runner, ssl_context=ssl_context)
        self._port, self._guard = port, guard

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl_context else 'http'}://0.0.0.0:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Guard(server(), self._guard),
            "0.0.0.0",
            self._port,
            ssl=self._ssl_context,
            ssl_handshake_timeout=self._guard.limits.idle_timeout_seconds if self._ssl_context else None,
            backlog=self._backlog,
            reuse_address=True,
        )
