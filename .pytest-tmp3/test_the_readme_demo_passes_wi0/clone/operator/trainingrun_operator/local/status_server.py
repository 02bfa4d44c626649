"""The operator's report endpoint, served on 127.0.0.1 for one local run.

Like the cluster's endpoint (`report_connections.ReportLimits`), it bounds what a client may hold: a request head must
arrive within `REQUEST_SECONDS` of the connection opening, its body at `BODY_BYTES_PER_SECOND` at least (else 408),
and at most `MAX_CONNECTIONS` are open at once (more are answered 503 and closed), so no client, broken or slow on
purpose, holds the endpoint or keeps the run's own reports out."""

from __future__ import annotations

import hmac
import json
import re
import secrets
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional

from trainingrun_api import contract, progress_report, run_figures

from .. import api

#: Seconds a connection has to bring its whole request head (and the grace its body gets on top of its size's time).
REQUEST_SECONDS = 10.0
#: The slowest a body may come (64 KiB, the largest report, then has 74 s at most).
BODY_BYTES_PER_SECOND = 1024.0
#: Connections open at once; one run's rank 0 reports over one at a time.
MAX_CONNECTIONS = 16
#: A Content-Length: ASCII digits only (int() would also take "-1", " 12", "1_000" and other scripts' digits).
_LENGTH = re.compile(r"[0-9]{1,9}", re.ASCII)
_BUSY_BODY = json.dumps({"message": "too many connections; send the report again"}).encode()
_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    + f"Content-Length: {len(_BUSY_BODY)}\r\n\r\n".encode()
    + _BUSY_BODY
)


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most `MAX_CONNECTIONS` at once: the next is answered 503 and closed by the
    accepting thread itself."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any):
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.open = 0
        self.closed = threading.Condition()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            try:
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        with self.closed:
            self.open += 1
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.closed:
                self.open -= 1
                self.closed.notify_all()
            self.slots.release()


class StatusServer:
    """The operator's report endpoint on 127.0.0.1 for one local run: the same protocol (progress_report.Report,
    a bearer token read from a file at each report), the same checks, and the status it keeps."""

    def __init__(self, run: api.TrainingRun, token_file: Path) -> None:
        self.status: dict[str, Any] = {}
        self.attempt = 0  #: reports of other attempts are refused, as the operator does
        self.reports = 0  #: reports taken so far
        #: The newest ProcessTime of every training process that reported, in the order they first did.
        self.processes: dict[str, progress_report.ProcessTime] = {}
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        token_file.parent.mkdir(parents=True, exist_ok=True)
        token_file.touch(mode=0o600)
        token_file.write_text(secrets.token_urlsafe(32))
        self.token_file = token_file
        server = self

        class Handler(BaseHTTPRequestHandler):
            def setup(self) -> None:
                super().setup()
                self.connection.settimeout(REQUEST_SECONDS)  # each read of the head
                # The head as a whole, however it trickles: past its time the connection is cut, unanswered.
                self.cut = threading.Timer(REQUEST_SECONDS, self._cut)
                self.cut.daemon = True
                self.cut.start()

            def _cut(self) -> None:
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            def finish(self) -> None:
                self.cut.cancel()
                super().finish()

            def do_POST(self) -> None:  # noqa: N802 - http.server naming
                self.cut.cancel()  # the head is in; the body has a time of its own
                declared = self.headers.get("Content-Length") or "0"
                if not _LENGTH.fullmatch(declared):
                    if declared.isascii() and declared.isdigit():
                        return self._answer(413, "report too large")
                    return self._answer(400, "Content-Length must be a number of bytes")
                length = int(declared)
                if self.path != contract.REPORT_PATH:
                    return self._answer(404, "no such endpoint")
                # As bytes: http.server reads a header as Latin-1, and compare_digest refuses non-ASCII text with a
                # TypeError (a traceback and no answer).
                if not hmac.compare_digest(
                    self.headers.get("Authorization", "").encode("latin-1", "replace"),
                    f"Bearer {server.token_file.read_text()}".encode("latin-1", "replace"),
                ):
                    return self._answer(401, "a bearer token is required")
                if length > progress_report.MAX_REPORT_BYTES:
                    return self._answer(413, "report too large")
                raw = self._body(length)
                if raw is None:
                    return self._answer(408, "the report's body did not arrive in time")
                try:
                    report = progress_report.Report.from_json(raw)
                except progress_report.ReportError as error:
                    return self._answer(400, str(error))
                meta = run.metadata
                refusal = report.refusal(
                    meta.namespace, meta.name, meta.uid or "", server.attempt, run.spec.checkpoint.uri
                )
                if refusal:
                    return self._answer(403, refusal)
                fields = report.status_fields()
                with server.changed:
                    if "progress" in fields:  # percent and ETA as the operator adds them in the cluster
                        fields["progress"] = run_figures.with_estimates(
                            server.status.get("progress"), fields["progress"]
                        )
                    server.status.update(fields)
                    if report.process_time:
                        server.processes[report.process_time.process] = report.process_time
                    server.reports += 1
                    server.changed.notify_all()
                self._answer(200, "ok")

            def _body(self, length: int) -> Optional[bytes]:
                """The body's `length` bytes, or None when they do not all arrive in their time."""
                deadline = time.monotonic() + REQUEST_SECONDS + length / BODY_BYTES_PER_SECOND
                chunks, received = [], 0
                while received < length:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    self.connection.settimeout(left)
                    try:
                        chunk = self.rfile.read1(length - received)
                    except (TimeoutError, OSError):
                        return None
                    if not chunk:
                        return None
                    chunks.append(chunk)
                    received += len(chunk)
                return b"".join(chunks)

            def _answer(self, code: int, message: str) -> None:
                self.close_connection = True
                body = json.dumps({"message": message}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = _BoundedServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}{contract.REPORT_PATH}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="local-status", daemon=True)
        self.thread.start()

    def process_times(self) -> list[progress_report.ProcessTime]:
        with self.lock:
            return list(self.processes.values())

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return json.loads(json.dumps(self.status))

    def report_count(self) -> int:
        with self.lock:
            return self.reports

    def new_attempt(self, number: int) -> None:
        """Reports of earlier attempts are refused from now on, and the previous attempt's step is not this one's."""
        with self.lock:
            self.attempt = number
            self.status.pop("progress", None)

    def wait_until_no_connection(self, timeout: float) -> bool:
        """Wait until no connection is open (or `timeout`); whether none is."""
        with self.httpd.closed:
            return self.httpd.closed.wait_for(lambda: self.httpd.open == 0, timeout)

    def wait_for_change(self, timeout: float) -> None:
        with self.changed:
            self.changed.wait(timeout)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
