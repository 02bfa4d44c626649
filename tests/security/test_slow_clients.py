"""Clients of the report endpoint that are slow on purpose, or broken: connections that send nothing, heads and bodies
a byte at a time, more connections than any pod needs. On main (aiohttp's defaults) each of them stayed open for an
hour; here each is closed within the endpoint's limits (reports.ReportLimits) and counted by reason, while a
well-behaved pod's reports are still accepted.

The endpoint runs as it does in the operator (`reports.serve`), on loopback, with limits small enough to see in
seconds; the token review is replaced by a pod of the run, as in test_hostile_reports.py. Connections from other
source addresses come from 127.0.0.2 and 127.0.0.3 (loopback's own range)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import pytest_asyncio
from test_hostile_reports import NOW, PodOfTheRun, report, view

from kube_cluster import free_port
from trainingrun_api import contract
from trainingrun_operator import reports
from trainingrun_operator.report_connections import ReportLimits

pytestmark = pytest.mark.asyncio
LIMITS = ReportLimits(
    idle_timeout_seconds=0.5, body_min_bytes_per_second=1000.0, max_connections=6, max_connections_per_address=4
)
#: Longer than any limit above lets a connection live: a connection still open after this was never closed.
NEVER = 10.0


@pytest_asyncio.fixture
async def endpoint():
    closed, accepted = [], []

    async def accept(key, fields, at_once=False):
        accepted.append(fields)

    served = reports.ReportEndpoint(
        PodOfTheRun(), view=view, accept=accept, clock=lambda: NOW, limits=LIMITS, on_closed=closed.append
    )
    port = free_port()
    task = asyncio.create_task(reports.serve(served, port, None))
    for _ in range(500):  # until it listens
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.01)
            continue
        writer.close()
        break
    await until(lambda: closed == ["no_request"])  # that probe itself, once the idle timeout closed it
    closed.clear()
    yield port, closed, accepted
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def until(condition, seconds: float = NEVER):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        await asyncio.sleep(0.01)


async def connect(port: int, source: str = "127.0.0.1"):
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def closed_within(reader: asyncio.StreamReader, seconds: float = NEVER) -> bytes:
    """What the server sent before it closed the connection; fails the test if it does not close within `seconds`."""
    try:
        return await asyncio.wait_for(reader.read(), seconds)
    except TimeoutError:
        pytest.fail(f"the connection was still open after {seconds} s")


def request(body: bytes, length: int | None = None) -> bytes:
    return (
        f"POST {contract.REPORT_PATH} HTTP/1.1\r\nHost: operator\r\nAuthorization: Bearer t\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body) if length is None else length}\r\n\r\n"
    ).encode() + body


async def test_connections_that_send_nothing_are_closed_after_the_idle_timeout(endpoint):
    port, closed, _ = endpoint
    connections = [await connect(port) for _ in range(3)]
    for reader, _ in connections:
        assert await closed_within(reader) == b""
    await until(lambda: closed == ["no_request"] * 3)


async def test_a_head_sent_a_byte_at_a_time_is_closed_before_it_ends(endpoint):
    port, closed, _ = endpoint
    reader, writer = await connect(port)
    head = request(json.dumps(report()).encode())
    sent = 0
    while not reader.at_eof() and sent < len(head):  # 10 bytes a second: the head would take minutes
        writer.write(head[sent : sent + 1])
        sent += 1
        try:
            await asyncio.wait_for(reader.read(1 << 16), 0.1)
        except TimeoutError:
            continue
    assert reader.at_eof() and sent < 40, f"sent {sent} bytes of {len(head)} and still open"
    await until(lambda: closed == ["no_request"])


@pytest.mark.slow
async def test_a_body_slower_than_the_minimum_rate_is_answered_408_and_closed(endpoint):
    port, closed, accepted = endpoint
    reader, writer = await connect(port)
    body = json.dumps(report()).encode()
    writer.write(request(b"", length=len(body)))  # a whole head, then the body a byte every 0.1 s
    answer = b""
    for byte in body:
        writer.write(bytes([byte]))
        try:
            answer += await asyncio.wait_for(reader.read(1 << 16), 0.1)  # read() to EOF would drop it on timeout
        except TimeoutError:
            continue
        break
    answer += await closed_within(reader)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"did not arrive within" in answer
    assert accepted == [] and "slow_body" in closed


async def test_connections_over_the_caps_are_refused_at_once_and_counted_until_they_close(endpoint):
    port, closed, _ = endpoint
    held = [await connect(port) for _ in range(LIMITS.max_connections_per_address)]
    reader, _ = await connect(port)  # one too many from this address
    assert (await closed_within(reader)).startswith(b"HTTP/1.1 503 ")
    held += [await connect(port, "127.0.0.2") for _ in range(LIMITS.max_connections - len(held))]
    reader, _ = await connect(port, "127.0.0.3")  # one too many in all, from an address that has none open
    assert (await closed_within(reader)).startswith(b"HTTP/1.1 503 ")
    assert closed == ["max_connections_per_address", "max_connections"]
    for held_reader, _ in held:  # the idle timeout frees every place they held
        await closed_within(held_reader)
    reader, writer = await connect(port, "127.0.0.3")
    writer.write(request(json.dumps(report(progress={"step": 5, "updatedAt": "2026-11-26T11:59:00Z"})).encode()))
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")


async def test_a_pod_reporting_on_a_kept_connection_is_served_and_reconnects_after_the_idle_timeout(endpoint):
    port, closed, accepted = endpoint
    reader, writer = await connect(port)
    for step in (1, 2):
        body = json.dumps(report(progress={"step": step, "updatedAt": "2026-11-26T11:59:00Z"})).encode()
        writer.write(request(body))
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))[15:])
        await reader.readexactly(length)
    assert await closed_within(reader) == b""  # idle after its answers: closed, having brought its requests
    assert closed == [] and len(accepted) >= 1
    reader, writer = await connect(port)
    writer.write(request(json.dumps(report(progress={"step": 3, "updatedAt": "2026-11-26T11:59:00Z"})).encode()))
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")


async def test_over_tls_a_handshake_that_never_comes_is_closed_and_a_pod_is_served(tmp_path):
    """The TLS handshake comes before aiohttp sees a connection: it is bounded by the idle timeout too (asyncio's
    default waits 60 s for it)."""
    import ssl

    from tls_files import certificate

    tls = certificate(tmp_path)
    served = reports.ReportEndpoint(PodOfTheRun(), view=view, accept=_nothing, clock=lambda: NOW, limits=LIMITS)
    port = free_port()
    task = asyncio.create_task(reports.serve(served, port, str(tls)))
    try:
        context = ssl.create_default_context(cafile=str(tls / "ca.crt"))
        for _ in range(500):  # until it listens
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
                break
            except OSError:
                await asyncio.sleep(0.01)
        writer.write(request(json.dumps(report(progress={"step": 1, "updatedAt": "2026-11-26T11:59:00Z"})).encode()))
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
        silent_reader, _ = await connect(port)  # TCP only: never a ClientHello
        assert await closed_within(silent_reader) == b""
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _nothing(key, fields, at_once=False):
    pass
