"""The report endpoint: where rank 0 of a trainer pod reports progress and committed checkpoints.

The operator alone writes a run's status; a pod only tells it what it saw, and what it says is input:

1. Who speaks (report_callers.py): the bearer token is a projected ServiceAccount token with the report audience
   (`contract.REPORT_AUDIENCE`). A TokenReview asking for that audience authenticates it and names the
   pod it is bound to (name and uid); answers are cached per token (by its sha256) for a while. Anyone who
   reaches the endpoint can send tokens: one that is not shaped like a pod's report token, or that names no pod
   of an active run, is refused without a TokenReview; new tokens are rate-limited per claimed pod and per
   source address, and reviews have a small lane of their own at the lowest API priority (`TokenReviewer`).
2. May it: the pod must be a pod of the run's current attempt, as the operator sees it (its pod index:
   same name and uid, the attempt's label, controlled by the attempt's PyTorchJob, or by a Job of its JobSet, which
   the run controls), in the run's namespace. A pod of another run (sharing a ServiceAccount or not), of an
   earlier attempt, or any other token is refused (401/403) and status stays as it is.
3. What it says: the report is parsed field by field (progress_report.Report) and must be about this run and
   attempt; a checkpoint must be a step directory under the URI the run started with (status.checkpointUri,
   which only the operator writes). Phase, budgets and the checkpoint URI are never taken from a report.

Accepted reports become a status patch (progress, lastGoodCheckpoint, lastReportTime), at most one per run every
STATUS_WRITE_SECONDS (the newest report wins) at the status priority. A report with no news (`news`: a new step
alone is none, a committed checkpoint is) is written at most every HEARTBEAT_WRITE_SECONDS, so a fleet's reports cost
few API writes.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import cachetools
from aiohttp import web

from trainingrun_api import contract, progress_report, run_figures

from . import naming, run_status
from .report_callers import TOKEN_CACHE_SIZE, Caller, Refused, TokenReviewer
from .report_connections import ConnectionGuard, GuardedSite, ReportLimits
from .runtime.kube import ApiError

log = logging.getLogger("trainingrun.reports")

#: A report with no news (only "still here", or a new step) is written to status at most this often (less with a
#: short stall timeout).
HEARTBEAT_WRITE_SECONDS = 30.0
#: A report's status fields are written at most this often per run; reports in between go with the next write,
#: the newest value of each field winning.
STATUS_WRITE_SECONDS = 3.0


def heartbeat_write_seconds(stall_timeout_seconds: int) -> float:
    """A third of a short stall timeout: lastReportTime must move more often than the stall check looks for it."""
    return min(HEARTBEAT_WRITE_SECONDS, stall_timeout_seconds / 3) if stall_timeout_seconds else HEARTBEAT_WRITE_SECONDS


@dataclass
class RunView:
    """What the endpoint needs to know about one run, from the operator's indexes."""

    uid: str
    attempt: int
    job_name: str
    checkpoint_uri: str
    status: dict[str, Any]
    pods: list[dict[str, Any]]  #: slim pods of the run (index)
    #: uids of what may control the current attempt's pods: its PyTorchJob, or its JobSet's Jobs, when the run controls
    #: that job (none otherwise)
    pod_controllers: frozenset[str]
    stall_timeout_seconds: int = 0  #: spec.recovery.stallTimeoutSeconds (0: off)
    job_kind: str = "PyTorchJob"  #: for messages


def check_pod(caller: Caller, run: RunView) -> None:
    """Refused unless the caller is a pod of the run's current attempt, controlled by that attempt's job (or its part)."""
    for pod in run.pods:
        meta = pod.get("metadata") or {}
        if meta.get("name") != caller.pod_name:
            continue
        owner = next((r.get("uid") for r in meta.get("ownerReferences") or [] if r.get("controller")), None)
        attempt = (meta.get("labels") or {}).get(naming.LABEL_ATTEMPT)
        if meta.get("uid") == caller.pod_uid and attempt == str(run.attempt) and owner in run.pod_controllers:
            return
        break
    raise Refused(
        403,
        f"pod {caller.namespace}/{caller.pod_name} is not a pod of attempt {run.attempt} "
        f"({run.job_kind} {run.job_name}) of this run",
    )


#: Status fields that move with the clock (run_status.account_time, the auto interval's estimate): alone they are no
#: reason to write status; they go with the next write.
TIME_FIELDS = ("processTime", "timeBreakdown", "checkpointInterval")
#: Status fields that move with nearly every report (the step, the newest checkpoint in memory): written with the
#: heartbeat, at most every heartbeat_write_seconds, so that a run costs the API server one write per heartbeat
#: rather than one per report (2,000 runs reporting every 10 s: 67 writes a second instead of 200). What a restart
#: or the user needs at once still goes at once (`news`): a committed checkpoint, a process's first step, the first
#: and the last step.
WITH_HEARTBEAT = ("progress", "checkpointInMemory")


def news(fields: dict[str, Any], status: dict[str, Any]) -> bool:
    """Whether a report's status fields say something status must show now, not with the next heartbeat."""
    if any(status.get(k) != v for k, v in fields.items() if k not in TIME_FIELDS + WITH_HEARTBEAT):
        return True
    progress, shown = fields.get("progress"), status.get("progress")
    if progress is None or progress == shown:
        return False
    total = progress.get("totalSteps")
    return shown is None or (total is not None and progress["step"] >= total)


def trains_again(report: progress_report.Report, status: dict[str, Any]) -> bool:
    """The first step of a process status has not seen yet (a start, a restart in place, a new attempt): what
    `kubectl get tr` shows as training again, so it is written at once rather than with the next write."""
    if report.progress is None or report.process_time is None:
        return False
    return report.process_time.process != ((status.get("processTime") or {}).get("current") or {}).get("process")


#: (status field, time field) of a report: times the pod states, which the stall watchdog and the checkpoint's age read.
REPORTED_TIMES = (("progress", "updatedAt"), ("lastGoodCheckpoint", "time"), ("checkpointInMemory", "time"))


def no_later_than_now(fields: dict[str, Any], now: datetime) -> None:
    """Clamp the times a pod reports to the operator's clock: a time in the future would keep the stall watchdog
    from ever firing (and show a checkpoint from tomorrow)."""
    for field, key in REPORTED_TIMES:
        stated = contract.parse_time((fields.get(field) or {}).get(key))
        if stated is not None and stated > now:
            fields[field][key] = contract.rfc3339(now)


class CoalescedWrites:
    """At most one status write per run every `seconds` (`write(key, fields)`): a report that comes sooner is merged
    into the write waiting for that run, the newest value of each field winning, so a pod that reports a thousand
    times a second costs its run one write per period. The first report after a quiet period is written at once.

    A report `at_once` (a new process's first step: the run trains again) goes ahead of the wait, taking what waits
    with it, once per period per run: a pod claiming a new process in every report costs at most one more write."""

    def __init__(
        self,
        write: Callable[[tuple[str, str], dict[str, Any]], Awaitable[None]],
        seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.write, self.seconds, self.clock = write, seconds, clock
        self.pending: dict[tuple[str, str], dict[str, Any]] = {}
        #: When each run was last written, and when its last `at_once` write went ahead of the wait; runs that
        #: stopped reporting drop out, least recently used first.
        self.last: cachetools.LRUCache[tuple[str, str], float] = cachetools.LRUCache(TOKEN_CACHE_SIZE)
        self.went_ahead: cachetools.LRUCache[tuple[str, str], float] = cachetools.LRUCache(TOKEN_CACHE_SIZE)
        self.flushing: dict[tuple[str, str], asyncio.Task] = {}

    async def submit(self, key: tuple[str, str], fields: dict[str, Any], at_once: bool = False) -> None:
        last = self.last.get(key)
        wait = (float("-inf") if last is None else last) + self.seconds - self.clock()
        if (key in self.pending or wait > 0) and at_once and self._may_go_ahead(key):
            fields = {**self.pending.pop(key, {}), **fields}
            self.flushing.pop(key, None)  # that task finds itself no longer the run's flush and writes nothing
            wait = 0
        if key in self.pending:
            self.pending[key].update(fields)
        elif wait > 0:
            self.pending[key] = dict(fields)
            self.flushing[key] = asyncio.create_task(self._flush(key, wait))  # held here: a task nobody holds may go
        else:
            await self._write(key, fields)

    def _may_go_ahead(self, key: tuple[str, str]) -> bool:
        now, went = self.clock(), self.went_ahead.get(key)
        if went is not None and now - went < self.seconds:
            return False
        self.went_ahead[key] = now
        return True

    async def _flush(self, key: tuple[str, str], wait: float) -> None:
        await asyncio.sleep(wait)
        if self.flushing.get(key) is not asyncio.current_task():
            return  # an at_once write took these fields
        fields = self.pending.pop(key)
        del self.flushing[key]
        try:
            await self._write(key, fields)
        except Exception as error:  # noqa: BLE001 - nobody awaits a deferred write: say it, the next report retries
            log.warning("writing the status of %s/%s from its reports failed: %s", *key, error)

    async def _write(self, key: tuple[str, str], fields: dict[str, Any]) -> None:
        self.last[key] = self.clock()
        await self.write(key, fields)


class ReportEndpoint:
    """The aiohttp application; `accept` writes status (the handlers module supplies it)."""

    def __init__(
        self,
        reviewer: TokenReviewer,
        view: Callable[[str, str], Optional[RunView]],
        accept: Callable[..., Awaitable[None]],
        clock: Callable[[], datetime],
        acting: Callable[[], bool] = lambda: True,
        limits: Optional[ReportLimits] = None,
        on_closed: Callable[[str], None] = lambda reason: None,
    ):
        self.reviewer, self.view, self.accept, self.clock = reviewer, view, accept, clock
        self.acting = acting  #: False on a replica that stands by: its indexes are not kept current
        self.limits = limits or ReportLimits()
        self.on_closed = on_closed  #: told each connection the endpoint closed itself, by CLOSED_REASONS

    def app(self) -> web.Application:
        app = web.Application(client_max_size=progress_report.MAX_REPORT_BYTES)
        app.router.add_post(contract.REPORT_PATH, self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        try:
            await self._take(request)
        except Refused as refusal:
            response = web.json_response({"message": str(refusal)}, status=refusal.code)
            if refusal.code == 408:
                response.force_close()
            return response
        return web.json_response({"message": "accepted"})

    async def _body(self, request: web.Request) -> bytes:
        seconds = self.limits.body_seconds(request.content_length)
        try:
            return await asyncio.wait_for(request.read(), seconds)  # asyncio.timeout is Python 3.11's; we keep 3.10
        except asyncio.TimeoutError:
            self.on_closed("slow_body")
            raise Refused(
                408,
                f"the report's body did not arrive within {seconds:.0f} s (at least "
                f"{self.limits.body_min_bytes_per_second:.0f} bytes a second)",
            ) from None

    async def _take(self, request: web.Request) -> None:
        if not self.acting():
            raise Refused(503, "this operator replica stands by for another one; send the report again")
        if (request.content_length or 0) > progress_report.MAX_REPORT_BYTES:
            raise Refused(413, f"reports are at most {progress_report.MAX_REPORT_BYTES} bytes")
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme != "Bearer" or not token:
            raise Refused(401, "a bearer token (the pod's projected report token) is required")
        try:
            caller = await self.reviewer.caller(token.strip(), request.remote or "")
        except (ApiError, OSError, asyncio.TimeoutError) as error:
            log.warning("TokenReview failed: %s", error)  # the error, never the token
            raise Refused(503, "cannot authenticate the report now; try again") from None
        if caller is None:
            raise Refused(401, f"the token is not a pod's ServiceAccount token for audience {contract.REPORT_AUDIENCE}")
        try:
            report = progress_report.Report.from_json(await self._body(request))
        except (progress_report.ReportError, web.HTTPRequestEntityTooLarge) as error:
            raise Refused(400, str(error)) from None
        if report.namespace != caller.namespace:
            raise Refused(403, f"a pod of namespace {caller.namespace} cannot report for namespace {report.namespace}")
        run = self.view(report.namespace, report.name)
        if run is None:
            raise Refused(404, f"no TrainingRun {report.namespace}/{report.name} is running")
        check_pod(caller, run)
        refusal = report.refusal(report.namespace, report.name, run.uid, run.attempt, run.checkpoint_uri)
        if refusal:
            raise Refused(403, refusal)
        fields = (
            report.status_fields()
        )  # checked once, by progress_report.Report; the status model is generated from it
        now = self.clock()
        no_later_than_now(fields, now)
        if "progress" in fields:
            fields["progress"] = run_figures.with_estimates(run.status.get("progress"), fields["progress"])
        if report.process_time:
            fields.update(
                run_status.account_time(
                    run.status,
                    report.process_time,
                    report.progress.productive_seconds if report.progress else None,
                    now,
                )
            )
        heard = contract.parse_time(run.status.get("lastReportTime"))
        at_once = trains_again(report, run.status)
        if (
            at_once
            or news(fields, run.status)
            or heard is None
            or (now - heard).total_seconds() >= heartbeat_write_seconds(run.stall_timeout_seconds)
        ):
            await self.accept(
                (report.namespace, report.name),
                {**fields, "lastReportTime": contract.rfc3339(now)},
                at_once=at_once,
            )


def server_ssl_context(tls_dir: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(Path(tls_dir) / "tls.crt"), str(Path(tls_dir) / "tls.key"))
    return context


async def serve(endpoint: ReportEndpoint, port: int, tls_dir: Optional[str]) -> None:
    """Serve until cancelled; HTTPS with the certificate in tls_dir (plain HTTP only when it is None), within
    `endpoint.limits`."""
    limits = endpoint.limits
    # aiohttp's keep-alive timer runs from a connection's opening and from each answer until a whole head came.
    runner = web.AppRunner(
        endpoint.app(), access_log=None, keepalive_timeout=limits.idle_timeout_seconds, lingering_time=2.0
    )
    await runner.setup()
    guard = ConnectionGuard(limits, endpoint.on_closed)
    site = GuardedSite(runner, port, server_ssl_context(tls_dir) if tls_dir else None, guard)
    await site.start()
    log.info("report endpoint listening on port %d (%s)", port, "https" if tls_dir else "http")
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
