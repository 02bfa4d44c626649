"""Who is reporting to the report endpoint (reports.py): a pod, named by its projected ServiceAccount token as a
TokenReview with the report audience answers; answers cached per token, new tokens rate-limited per claimed pod and
per source address, junk refused without a review."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import cachetools

from trainingrun_api import contract

from .runtime.kube import REVIEW, Kube

log = logging.getLogger("trainingrun.reports")

POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
#: Refused tokens are remembered this long, so a flood of bad tokens is not a flood of TokenReviews.
REFUSED_TOKEN_SECONDS = 10.0
#: Tokens remembered, accepted and refused apart (least recently used evicted first): a flood of junk tokens
#: churns the refused ones only, never a pod's accepted token.
TOKEN_CACHE_SIZE = 20000
#: The longest bearer token reviewed (a projected ServiceAccount token is about 1 KB).
MAX_TOKEN_BYTES = 8192


class Refused(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


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
    return ClaimedPod(str(namespace), pod["name"], pod["uid"])


class RateLimiter:
    """A token bucket per key (a claimed pod, a source address): `rate` per second, up to `burst` at once; at most
    `keys` remembered."""

    def __init__(self, rate: float, burst: float, keys: int = 10000, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.buckets: cachetools.LRUCache[str, tuple[float, float]] = cachetools.LRUCache(keys)

    def allow(self, key: str) -> bool:
        now = self.clock()
        tokens, then = self.buckets.get(key) or (self.burst, now)
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if tokens < 1:
            self.buckets[key] = (tokens, now)
            return False
        self.buckets[key] = (tokens - 1, now)
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
    memory in between, whatever a flood does; when its review is due and the limits have no room, its last answer
    stands for up to one more period (`deferred`), so a fleet whose tokens fall due together is not refused."""

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
        #: An accepted token: (when its next review is due, its caller), kept one period past that (`deferred`).
        self.accepted: cachetools.TTLCache[bytes, tuple[float, Caller]] = cachetools.TTLCache(
            TOKEN_CACHE_SIZE, ttl=2 * cache_seconds, timer=clock
        )
        self.refused: cachetools.TTLCache[bytes, bool] = cachetools.TTLCache(
            TOKEN_CACHE_SIZE, ttl=REFUSED_TOKEN_SECONDS, timer=clock
        )
        self.per_pod = RateLimiter(per_pod_rate, per_pod_burst, clock=clock)
        self.per_source = RateLimiter(per_source_rate, per_source_burst, clock=clock)
        self.lane = asyncio.Semaphore(reviews_in_flight)
        self.waiting, self.reviews_waiting = 0, reviews_waiting
        self.reviews = 0
        self.refused_unreviewed = 0  #: tokens refused without a TokenReview (shape, audience, expiry, unknown pod)
        self.throttled = 0  #: reports answered 429 (a pod or source over its rate, or the review lane full)
        self.deferred = 0  #: accepted tokens due for review answered from memory while the lane was full

    async def caller(self, token: str, source: str = "") -> Optional[Caller]:
        if (
            len(token) > MAX_TOKEN_BYTES or not token.isascii()
        ):  # a JWT is ASCII; aiohttp hands other bytes as surrogates
            self.refused_unreviewed += 1
            return None
        key = hashlib.sha256(token.encode()).digest()
        now = self.clock()
        due: Optional[Caller] = None  #: an accepted token whose next review is due, within one more period
        accepted = self.accepted.get(key)
        if accepted is not None:
            review_due, due = accepted
            if now < review_due:
                return due
        elif key in self.refused:
            return None
        pod = claimed_pod(token, self.wall_clock())
        if pod is None:
            self.refused_unreviewed += 1
            self.accepted.pop(key, None)
            self.refused[key] = True
            return None
        if not self.known_pod(pod):  # not remembered: the pod may be new, and the index sees it in a moment
            self.refused_unreviewed += 1
            return None
        if not self.per_pod.allow(pod.uid) or not self.per_source.allow(source) or self.waiting >= self.reviews_waiting:
            if due is not None:
                # A fleet's tokens fall due together, and the limits are for new ones. This one was good a period
                # ago, has not expired, and its pod is still one of a run (the report is checked against the pod
                # index after this): its answer stands until a later report finds room, at most one more period.
                self.deferred += 1
                return due
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
            self.accepted.pop(key, None)
            self.refused[key] = True
        else:
            self.accepted[key] = (now + self.cache_seconds, caller)
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
