"""The operator's report endpoint, served on 127.0.0.1 for one local run."""

from __future__ import annotations

import hmac
import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from trainingrun_api import contract, progress_report, run_figures

from .. import api


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
            def do_POST(self) -> None:  # noqa: N802 - http.server naming
                length = int(self.headers.get("Content-Length") or 0)
                if self.path != contract.REPORT_PATH:
                    return self._answer(404, "no such endpoint")
                if not hmac.compare_digest(
                    self.headers.get("Authorization", ""), f"Bearer {server.token_file.read_text()}"
                ):
                    return self._answer(401, "a bearer token is required")
                if length > progress_report.MAX_REPORT_BYTES:
                    return self._answer(413, "report too large")
                try:
                    report = progress_report.Report.from_json(self.rfile.read(length))
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

            def _answer(self, code: int, message: str) -> None:
                body = json.dumps({"message": message}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
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

    def wait_for_change(self, timeout: float) -> None:
        with self.changed:
            self.changed.wait(timeout)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
