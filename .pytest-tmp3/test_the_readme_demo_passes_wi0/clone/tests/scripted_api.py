"""A loopback HTTP server that answers byte for byte what a test scripts, with the operator's API client (`kube.Kube`)
pointed at it: for what no real API server sends (answers cut off, bytes that are not HTTP, an idle close)."""

from __future__ import annotations

import asyncio

import kopf

from trainingrun_operator.runtime.kube import Kube


class Scripted:
    """Each request read is answered with the next scripted bytes (a tuple: parts written one after another); after
    an answer whose parts end in None the connection is closed, after the last one it is held open. Counts
    connections and keeps the requests."""

    def __init__(self, *answers, **kube_options):
        self.answers, self.connections, self.requests = list(answers), 0, []
        self.kube_options = kube_options

    async def __aenter__(self) -> "Scripted":
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        info = kopf.ConnectionInfo(server=f"http://127.0.0.1:{port}/prefix", insecure=True, token="t")
        self.kube = Kube(info, **{"backoff_seconds": 0.01, **self.kube_options})
        return self

    async def __aexit__(self, *exc) -> None:
        await self.kube.close()
        self.server.close()
        await self.server.wait_closed()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
