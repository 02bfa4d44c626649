"""Rank 0 reports progress and committed checkpoints to the operator (or `trainingrun local`).

The protocol is `progress_report.Report`, POSTed to the endpoint the operator names in the environment.
Best effort by design: a background thread sends the newest values at a bounded rate, so a slow or
unreachable operator never stalls a training step, and a failure is logged once, not every report.
It also sends when nothing changed (a heartbeat), so the operator can tell a stalled trainer from
a reporting outage. News goes at once, without waiting for the interval: where a start stands (the
step it resumed from), its first step (the run trains again) and every committed checkpoint; reports
stay at least MIN_SECONDS_APART apart all the same. The token is read from its file at each report:
the kubelet rotates projected tokens, and a token read once would expire. Without a report URL (a plain torchrun) nothing is sent.
Only the standard library is used: the trainer image needs no Kubernetes client.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Mapping, Optional

from trainingrun_api import contract
from trainingrun_api.progress_report import (
    CheckpointInMemory,
    CommittedCheckpoint,
    IntervalChoice,
    MemoryShort,
    ProcessTime,
    Progress,
    Report,
    SlowRank,
)

log = logging.getLogger("trainingrun.reporting")


@dataclass(frozen=True)
class ReportEndpoint:
    """Where reports go and how this process proves who it is."""

    url: str
    token_file: Optional[str]  #: read at every report
    ca_file: Optional[str]  #: verifies the endpoint's TLS certificate (https)

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> Optional["ReportEndpoint"]:
        env = os.environ if env is None else env
        url = env.get(contract.REPORT_URL)
        if not url:
            return None
        return cls(url, env.get(contract.REPORT_TOKEN_FILE) or None, env.get(contract.REPORT_CA_FILE) or None)

    def token(self) -> str:
        if not self.token_file:
            return ""
        with open(self.token_file, encoding="utf-8") as f:
            return f.read().strip()


class ProgressReporter:
    """Sends `Report`s of one attempt; `progress()` and `committed()` never block and never raise."""

    def __init__(
        self,
        endpoint: Optional[ReportEndpoint],
        identity: Report,
        interval_seconds: float = contract.DEFAULT_REPORT_INTERVAL_SECONDS,
        timeout_seconds: float = 10.0,
    ):
        self.endpoint = endpoint
        self.identity = identity
        self.interval = interval_seconds
        self.timeout = timeout_seconds
        self.failures = 0
        self.sent = 0
        self._progress: Optional[Progress] = None
        self._checkpoint: Optional[CommittedCheckpoint] = None
        self._in_memory: Optional[CheckpointInMemory] = None
        self._memory_short: Optional[MemoryShort] = None
        self._slow_rank: Optional[SlowRank] = None
        self._process_time: Optional[ProcessTime] = None
        self._interval: Optional[IntervalChoice] = None
        self._first_step: Optional[int] = None  #: the step of this process's first progress
        self._stepped = False  #: a later step was reported: the process trains
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._news = threading.Event()  #: something to send before the interval is up (or close)
        self._failing = False
        self._thread: Optional[threading.Thread] = None
        if endpoint:
            self._thread = threading.Thread(target=self._run, name="progress-reporter", daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None

    def progress(
        self, progress: Progress, process_time: Optional[ProcessTime] = None, interval: Optional[IntervalChoice] = None
    ) -> None:
        with self._lock:
            news = self._first_step is None or (not self._stepped and progress.step != self._first_step)
            if self._first_step is None:
                self._first_step = progress.step
            elif progress.step != self._first_step:
                self._stepped = True
            self._progress = progress
            self._process_time = process_time or self._process_time
            self._interval = interval or self._interval
        if news:
            self._news.set()

    def process_time(self, process_time: ProcessTime) -> None:
        """Where this process's time went, newer than its last progress's (a hung process's last word): news."""
        with self._lock:
            self._process_time = process_time
        self._news.set()

    def committed(self, checkpoint: CommittedCheckpoint) -> None:
        with self._lock:
            news = self._checkpoint is None or self._checkpoint.step != checkpoint.step
            self._checkpoint = checkpoint
        if news:
            self._news.set()

    def memory_short(self, short: MemoryShort) -> None:
        """The pods whose memory lacked room for the last checkpoint (or none again): sent soon, as news."""
        with self._lock:
            self._memory_short = short
        self._news.set()

    def slow_rank(self, slow: SlowRank) -> None:
        """A straggler named (or none any more, `rank` absent): sent soon, as news."""
        with self._lock:
            self._slow_rank = slow
        self._news.set()

    def committed_in_memory(self, checkpoint: CheckpointInMemory) -> None:
        """Persisting behind, the newest checkpoint in memory: sent with the next report, not sooner (a checkpoint
        every few steps must not mean a report every few steps)."""
        with self._lock:
            self._in_memory = checkpoint

    def close(self, flush_timeout: float = 5.0) -> None:
        """Send the newest values (bounded by flush_timeout) and stop the thread."""
        if not self._thread:
            return
        self._stop.set()
        self._news.set()
        self._thread.join(flush_timeout)

    def _run(self) -> None:
        while True:
            self._send(self._report())
            sent_at = time.monotonic()
            # The next report after the interval (a heartbeat when nothing changed), sooner with news, at once on close.
            self._news.wait(self.interval)
            self._news.clear()
            if not self._stop.is_set():
                self._stop.wait(sent_at + min(MIN_SECONDS_APART, self.interval) - time.monotonic())
            if self._stop.is_set():
                self._send(self._report())
                return

    def _report(self) -> Report:
        with self._lock:
            return Report.model_construct(
                namespace=self.identity.namespace,
                name=self.identity.name,
                uid=self.identity.uid,
                attempt=self.identity.attempt,
                progress=self._progress,
                last_good_checkpoint=self._checkpoint,
                process_time=self._process_time,
                checkpoint_interval=self._interval,
                checkpoint_in_memory=self._in_memory,
                checkpoint_memory_short=self._memory_short,
                slow_rank=self._slow_rank,
            )

    def _send(self, report: Report) -> None:
        assert self.endpoint is not None
        try:
            self._post(report)
            self.sent += 1
            if self._failing:
                log.info("progress reporting works again")
            self._failing = False
        except Exception as error:  # noqa: BLE001 - reporting must never stop training
            self.failures += 1
            if not self._failing:
                # The URL, the status and the reason only: never the token.
                status = getattr(error, "code", None)
                log.warning(
                    "cannot report progress to %s (%s%s); training continues, will keep trying",
                    self.endpoint.url,
                    f"{status} " if status else "",
                    getattr(error, "reason", None) or type(error).__name__,
                )
            self._failing = True

    def _post(self, report: Report) -> None:
        assert self.endpoint is not None
        post(self.endpoint, report, self.timeout)


def post(endpoint: ReportEndpoint, report: Report, timeout: float) -> None:
    """POST once; a 503 (a standby operator replica, or authentication unavailable for a moment) is sent again at
    once on a new connection, which the operator's Service may route to the replica that acts."""
    context = ssl.create_default_context(cafile=endpoint.ca_file) if endpoint.url.startswith("https://") else None
    for attempt in range(SENDS_ON_503):
        request = urllib.request.Request(
            endpoint.url,
            data=report.to_json(),
            method="POST",
            headers={"Authorization": f"Bearer {endpoint.token()}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
                response.read()
            return
        except urllib.error.HTTPError as error:
            if error.code != 503 or attempt == SENDS_ON_503 - 1:
                raise


def send_now(report: Report, timeout: float = 5.0, env: Optional[Mapping[str, str]] = None) -> bool:
    """One report from any rank, sent before this returns (a hang's diagnosis, just before the process exits);
    False when there is no endpoint or it could not be sent (logged without the token)."""
    endpoint = ReportEndpoint.from_env(env)
    if endpoint is None:
        return False
    try:
        post(endpoint, report, timeout)
        return True
    except Exception as error:  # noqa: BLE001 - the caller exits next whatever happens here
        log.warning("cannot report to %s (%s)", endpoint.url, getattr(error, "reason", None) or type(error).__name__)
        return False


#: News (a first step, a committed checkpoint) goes before the interval is up, but never sooner than this after the
#: report before it: a checkpoint every step still costs the operator at most two reports a second.
MIN_SECONDS_APART = 0.5

#: Tries per report when the answer is 503: with two operator replicas, 1 in 16 reports is left for the next.
SENDS_ON_503 = 4


def from_env(identity: Report, env: Optional[Mapping[str, str]] = None) -> ProgressReporter:
    env = os.environ if env is None else env
    interval = float(env.get(contract.REPORT_INTERVAL_SECONDS) or contract.DEFAULT_REPORT_INTERVAL_SECONDS)
    return ProgressReporter(ReportEndpoint.from_env(env), identity, interval_seconds=interval)
