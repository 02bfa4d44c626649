"""report_connections: the counts behind the report endpoint's connection caps, and how a connection's first request
head is recognised (the endpoint itself, slow clients and all: tests/security/test_slow_clients.py)."""

import asyncio

from trainingrun_operator.report_connections import ConnectionGuard, ReportLimits, _Guard


class Inner(asyncio.Protocol):
    def __init__(self):
        self.received, self.made, self.lost = b"", False, False

    def connection_made(self, transport):
        self.made = True

    def data_received(self, data):
        self.received += data

    def connection_lost(self, exc):
        self.lost = True


class Transport:
    def __init__(self, address="10.0.0.1"):
        self.address, self.written, self.closed = address, b"", False

    def get_extra_info(self, name):
        return (self.address, 5555) if name == "peername" else None

    def write(self, data):
        self.written += data

    def close(self):
        self.closed = True


def test_a_head_is_recognised_however_its_bytes_arrive_and_every_byte_reaches_aiohttp():
    request = b"POST /v1/reports HTTP/1.1\r\nHost: x\r\n\r\n{}"
    for split in (1, 2, 3, 5, len(request)):
        closed, inner = [], Inner()
        guard = _Guard(inner, ConnectionGuard(ReportLimits(), closed.append))
        guard.connection_made(Transport())
        head_end = request.index(b"\r\n\r\n") + 4
        for at in range(0, len(request), split):
            guard.data_received(request[at : at + split])
            assert (guard.head is None) == (at + split >= head_end), (split, at)
        guard.connection_lost(None)
        assert inner.received == request and inner.lost and closed == []  # brought its request: not "no_request"


def test_a_connection_that_never_brings_a_head_is_counted_when_it_closes():
    closed = []
    guard = _Guard(Inner(), ConnectionGuard(ReportLimits(), closed.append))
    guard.connection_made(Transport())
    guard.data_received(b"POST / HTTP/1.1\r\nHost")
    guard.connection_lost(None)
    assert closed == ["no_request"]


def test_the_caps_count_open_connections_and_give_places_back():
    counts = ConnectionGuard(ReportLimits(max_connections=3, max_connections_per_address=2))
    assert [counts.admit("a"), counts.admit("a"), counts.admit("a")] == [None, None, "max_connections_per_address"]
    assert counts.admit("b") is None and counts.admit("c") == "max_connections"
    counts.release("a")
    assert counts.admit("c") is None and counts.open == 3 and dict(counts.per_address) == {"a": 1, "b": 1, "c": 1}
    for address in ("a", "b", "c"):
        counts.release(address)
    assert counts.open == 0 and not counts.per_address


def test_a_refused_connection_gets_a_503_and_never_reaches_aiohttp():
    closed, inner, transport = [], Inner(), Transport()
    counts = ConnectionGuard(ReportLimits(max_connections_per_address=1), closed.append)
    counts.admit("10.0.0.1")
    guard = _Guard(inner, counts)
    guard.connection_made(transport)
    guard.data_received(b"GET / HTTP/1.1\r\n\r\n")
    guard.connection_lost(None)
    assert transport.written.startswith(b"HTTP/1.1 503 ") and transport.closed
    assert not inner.made and inner.received == b"" and not inner.lost
    assert closed == ["max_connections_per_address"] and counts.open == 1  # the one admitted before, not this one
