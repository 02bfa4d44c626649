"""The report endpoint: where rank 0 of a trainer pod reports progress and committed checkpoints.

The operator alone writes a run's status; a pod only tells it what it saw, and what it says is input:

1. Who speaks: the bearer token is a projected ServiceAccount token with the report audience
   (`contract.REPORT_AUDIENCE`). A TokenReview asking for that audience authenticates it and names the
   pod it is bound to (name and uid); answers are cached per token (by its sha256) for a while. Anyone who
   reaches the endpoint can send tokens: one that is not shaped like a pod's report token, or that names no pod
   of an active run, is refused without a TokenReview; new tokens are rate-limited per claimed pod and per
   source address, and reviews have a small lane of their own at the lowest API priority (`TokenReviewer`).
2. May it: the pod must be a pod of the run's current attempt, as the operator sees it (its pod index:
   same name and uid, the attempt's label, controlled by the attempt's PyTorchJob, which the run
   controls), in the run's namespace. A pod of another run (sharing a ServiceAccount or not), of an
   earlier attempt, or any other token is refused (401/403) and status stays as it is.
3. What it says: the report is parsed field by field (progress_report.Report) and must be about this run and
   attempt; a checkpoint must be a step directory under the URI the run started with (status.checkpointUri,
   which only the operator writes). Phase, budgets and the checkpoint URI are never taken from a report.

Accepted reports become a status patch (progress, lastGoodCheckpoint, lastReportTime), at most one per run every
STATUS_WRITE_SECONDS (the newest report wins) at the status priority. A report that
changes nothing is written at most every HEARTBEAT_WRITE_SECONDS, so heartbeats cost few API writes.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import hashlib
import json
import logging
import ssl
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from aiohttp import web

from trainingrun_api import contract, progress_report

from . import naming, run_status
from .kube import REVIEW, ApiError, Kube

log = logging.getLogger("trainingrun.reports")

POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
#: A report that only says "still here" is written to status at most this often (less with a short stall timeout).
HEARTBEAT_WRITE_SECONDS = 30.0
#: Refused tokens are remembered this long, so a flood of bad tokens is not a flood of TokenReviews.
REFUSED_TOKEN_SECONDS = 10.0
#: Tokens remembered, accepted and refused apart (least recently used evicted first): a flood of junk tokens
#: churns the refused ones only, never a pod's accepted token.
TOKEN_CACHE_SIZE = 20000
#: The longest bearer token reviewed (a projected ServiceAccount token is about 1 KB).
MAX_TOKEN_BYTES = 8192
#: A report's status fields are written at most this often per run; reports in between go with the next write,
#: the newest value of each field winning.
STATUS_WRITE_SECONDS = 3.0


def heartbeat_write_seconds(stall_timeout_seconds: int) -> float:
    """A third of a short stall timeout: lastReportTime must move more often than the stall check looks for it."""
    return min(HEARTBEAT_WRITE_SECONDS, stall_timeout_seconds / 3) if stall_timeout_seconds else HEARTBEAT_WRITE_SECONDS


@dataclass(frozen=True)
class ClaimedPod:
    """The pod a report token says it is bound to, before a TokenReview has confirmed anything."""

    namespace: str
    name: str
    uid: str


def claimed_pod(token: str, now: float) -> Optional[ClaimedPod]:
    """The pod `token` claims to be bound to when it may be a pod's projected report token (None: it is not shaped
    like one, is for another audience, has expired or names no pod); read without its signature: only a TokenReview
    tells whether it is one. A junk token costs the API server nothing: it is refused here first."""
    if len(token) > MAX_TOKEN_BYTES or not token.isascii():
        return None
    parts = token.split(".")
    if len(parts) != 3 or not all(parts):
        return None
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(claims, dict):
        return None
    audiences = claims.get("aud")
    audiences = [audiences] if isinstance(audiences, str) else audiences
    if not isinstance(audiences, list) or contract.REPORT_AUDIENCE not in audiences:
        return None
    expires = claims.get("exp")
    if not isinstance(expires, (int, float)) or expires < now:
        return None
    bound = claims.get("kubernetes.io")
    pod = bound.get("pod") if isinstance(bound, dict) else None
    namespace = bound.get("namespace") if isinstance(bound, dict) else None
    if not isinstance(pod, dict) or not all(
        isinstance(v, str) and v for v in (namespace, pod.get("name"), pod.get("uid"))
    ):
        return None
    return ClaimedPod(namespace, pod["name"], pod["uid"])


class Lru:
    """A dict of at most `size` entries that forgets the least recently used first."""

    def __init__(self, size: int):
        self.size, self.entries = size, collections.OrderedDict()

    def get(self, key: Any) -> Any:
        found = self.entries.get(key)
        if found is not None:
            self.entries.move_to_end(key)
        return found

    def put(self, key: Any, value: Any) -> None:
        self.entries[key] = value
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def pop(self, key: Any) -> None:
        self.entries.pop(key, None)

    def __len__(self) -> int:
        return len(self.entries)


class RateLimiter:
    """A token bucket per key (a claimed pod, a source address): `rate` per second, up to `burst` at once; at most
    `keys` remembered."""

    def __init__(self, rate: float, burst: float, keys: int = 10000, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.buckets = Lru(keys)

    def allow(self, key: str) -> bool:
        now = self.clock()
        tokens, then = self.buckets.get(key) or (self.burst, now)
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if tokens < 1:
            self.buckets.put(key, (tokens, now))
            return False
        self.buckets.put(key, (tokens - 1, now))
        return True


@dataclass(frozen=True)
class Caller:
    """A pod, as its token's TokenReview names it."""

    namespace: str
    service_account: str
    pod_name: str
    pod_uid: str


class TokenReviewer:
    """Authenticates report tokens with TokenReview (audience: contract.REPORT_AUDIENCE), cached per token.

    A token the cache does not know costs a TokenReview only when it looks like a projected report token bound to a
    pod (`claimed_pod`) that is a pod of an active run (`known_pod`, from the operator's index: a forged token names
    none), that pod and the token's source address are within their rates (`per_pod_rate` and `per_source_rate` a
    second, with bursts), and the review lane has room: `reviews_in_flight` reviews at a time, at the lowest API
    priority (below the operator's own reconciles, status and Events), `reviews_waiting` more waiting; beyond that
    the report is answered 429 at once. A pod's accepted token is reviewed once per `cache_seconds` and answered from
    memory in between, whatever a flood does."""

    def __init__(
        self,
        kube: Callable[[], Kube],
        cache_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        known_pod: Callable[[ClaimedPod], bool] = lambda pod: True,
        reviews_in_flight: int = 2,
        reviews_waiting: int = 16,
        per_pod_rate: float = 0.2,
        per_pod_burst: float = 3,
        per_source_rate: float = 20.0,
        per_source_burst: float = 200.0,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.kube, self.cache_seconds, self.clock, self.wall_clock = kube, cache_seconds, clock, wall_clock
        self.known_pod = known_pod
        self.accepted, self.refused = Lru(TOKEN_CACHE_SIZE), Lru(TOKEN_CACHE_SIZE)
        self.per_pod = RateLimiter(per_pod_rate, per_pod_burst, clock=clock)
        self.per_source = RateLimiter(per_source_rate, per_source_burst, clock=clock)
        self.lane = asyncio.Semaphore(reviews_in_flight)
        self.waiting, self.reviews_waiting = 0, reviews_waiting
        self.reviews = 0
        self.refused_unreviewed = 0  #: tokens refused without a TokenReview (shape, audience, expiry, unknown pod)
        self.throttled = 0  #: reports answered 429 (a pod or source over its rate, or the review lane full)

    async def caller(self, token: str, source: str = "") -> Optional[Caller]:
        key = hashlib.sha256(token.encode()).digest()
        now = self.clock()
        for cache in (self.accepted, self.refused):
            cached = cache.get(key)
            if cached is not None:
                if cached[0] > now:
                    return cached[1]
                cache.pop(key)
        pod = claimed_pod(token, self.wall_clock())
        if pod is None:
            self.refused_unreviewed += 1
            self.refused.put(key, (now + REFUSED_TOKEN_SECONDS, None))
            return None
        if not self.known_pod(pod):  # not remembered: the pod may be new, and the index sees it in a moment
            self.refused_unreviewed += 1
            return None
        if not self.per_pod.allow(pod.uid) or not self.per_source.allow(source) or self.waiting >= self.reviews_waiting:
            self.throttled += 1
            raise Refused(429, "too many new report tokens; send the report again later")
        self.waiting += 1
        entered = False
        try:
            async with self.lane:
                self.waiting, entered = self.waiting - 1, True
                caller = await self._review(token)
        finally:
            if not entered:  # cancelled while waiting for the lane
                self.waiting -= 1
        if caller is None:
            self.refused.put(key, (now + REFUSED_TOKEN_SECONDS, None))
        else:
            self.accepted.put(key, (now + self.cache_seconds, caller))
        return caller

    async def _review(self, token: str) -> Optional[Caller]:
        self.reviews += 1
        review = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [contract.REPORT_AUDIENCE]},
        }
        answer = (
            await self.kube().request("POST", "/apis/authentication.k8s.io/v1/tokenreviews", review, priority=REVIEW)
        ).get("status") or {}
        user = answer.get("user") or {}
        parts = (user.get("username") or "").split(":")
        extra = user.get("extra") or {}
        pod_name, pod_uid = (extra.get(POD_NAME_EXTRA) or [None])[0], (extra.get(POD_UID_EXTRA) or [None])[0]
        if (
            not answer.get("authenticated")
            or contract.REPORT_AUDIENCE not in (answer.get("audiences") or [])
            or len(parts) != 4
            or parts[:2] != ["system", "serviceaccount"]
            or not pod_name
            or not pod_uid
        ):
            return None  # not a pod-bound ServiceAccount token for the report audience
        return Caller(namespace=parts[2], service_account=parts[3], pod_name=pod_name, pod_uid=pod_uid)


@dataclass
class RunView:
    """What the endpoint needs to know about one run, from the operator's indexes."""

    uid: str
    attempt: int
    job_name: str
    checkpoint_uri: str
    status: dict[str, Any]
    pods: list[dict[str, Any]]  #: slim pods of the run (index)
    job_uid: Optional[str]  #: uid of the current attempt's PyTorchJob, when the run controls it
    stall_timeout_seconds: int = 0  #: spec.recovery.stallTimeoutSeconds (0: off)


class Refused(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def check_pod(caller: Caller, run: RunView) -> None:
    """Refused unless the caller is a pod of the run's current attempt, controlled by that attempt's job."""
    for pod in run.pods:
        meta = pod.get("metadata") or {}
        if meta.get("name") != caller.pod_name:
            continue
        owner = next((r.get("uid") for r in meta.get("ownerReferences") or [] if r.get("controller")), None)
        attempt = (meta.get("labels") or {}).get(naming.LABEL_ATTEMPT)
        if meta.get("uid") == caller.pod_uid and attempt == str(run.attempt) and run.job_uid and owner == run.job_uid:
            return
        break
    raise Refused(
        403,
        f"pod {caller.namespace}/{caller.pod_name} is not a pod of attempt {run.attempt} "
        f"(PyTorchJob {run.job_name}) of this run",
    )


#: Status fields that move with the clock (run_status.account_time, the auto interval's estimate): alone they are no
#: reason to write status; they go with the next write.
TIME_FIELDS = ("processTime", "timeBreakdown", "checkpointInterval")


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
        self.last = Lru(TOKEN_CACHE_SIZE)  #: when each run was last written (runs that stopped reporting drop out)
        self.went_ahead = Lru(TOKEN_CACHE_SIZE)  #: when each run's last `at_once` write went ahead of the wait
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
        self.went_ahead.put(key, now)
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
        self.last.put(key, self.clock())
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
    ):
        self.reviewer, self.view, self.accept, self.clock = reviewer, view, accept, clock
        self.acting = acting  #: False on a replica that stands by: its indexes are not kept current

    def app(self) -> web.Application:
        app = web.Application(client_max_size=progress_report.MAX_REPORT_BYTES)
        app.router.add_post(contract.REPORT_PATH, self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        try:
            await self._take(request)
        except Refused as refusal:
            return web.json_response({"message": str(refusal)}, status=refusal.code)
        return web.json_response({"message": "accepted"})

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
            report = progress_report.Report.from_json(await request.read())
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
            fields["progress"] = progress_report.with_estimates(run.status.get("progress"), fields["progress"])
        if report.process_time:
            fields.update(
                run_status.account_time(
                    run.status, report.process_time, report.progress and report.progress.productive_seconds, now
                )
            )
        heard = contract.parse_time(run.status.get("lastReportTime"))
        # The clocks move at every report; they alone are no reason to write (they go with the next write).
        changed = any(run.status.get(k) != v for k, v in fields.items() if k not in TIME_FIELDS)
        if (
            changed
            or heard is None
            or (now - heard).total_seconds() >= heartbeat_write_seconds(run.stall_timeout_seconds)
        ):
            await self.accept(
                (report.namespace, report.name),
                {**fields, "lastReportTime": contract.rfc3339(now)},
                at_once=trains_again(report, run.status),
            )


def server_ssl_context(tls_dir: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(Path(tls_dir) / "tls.crt"), str(Path(tls_dir) / "tls.key"))
    return context


async def serve(endpoint: ReportEndpoint, port: int, tls_dir: Optional[str]) -> None:
    """Serve until cancelled; HTTPS with the certificate in tls_dir (plain HTTP only when it is None)."""
    runner = web.AppRunner(endpoint.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "0.0.0.0", port, ssl_context=server_ssl_context(tls_dir) if tls_dir else None)
    await site.start()
    log.info("report endpoint listening on port %d (%s)", port, "https" if tls_dir else "http")
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
