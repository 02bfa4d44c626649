"""report_callers: a junk, expired, foreign or unbound token is refused before any TokenReview; the rate limits hold
per pod and per source; an accepted token is reviewed once per period, and one due while the limits are full keeps
its last answer for one more period. The TokenReview itself runs against a real API server in
tests/real_api/test_reports_real.py; here a stand-in answers it, so the test can count reviews and choose answers."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from trainingrun_api import contract
from trainingrun_operator.report_callers import (
    MAX_TOKEN_BYTES,
    POD_NAME_EXTRA,
    POD_UID_EXTRA,
    ClaimedPod,
    RateLimiter,
    Refused,
    TokenReviewer,
    claimed_pod,
)

NOW = 1_800_000_000.0


def token(claims, signature="sig") -> str:
    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    return f"eyJhbGciOiJSUzI1NiJ9.{body}.{signature}"


def pod_claims(name="demo-a1-worker-0", uid="u-1", namespace="team-a", aud=None, exp=NOW + 600):
    return {
        "aud": [contract.REPORT_AUDIENCE] if aud is None else aud,
        "exp": exp,
        "kubernetes.io": {"namespace": namespace, "pod": {"name": name, "uid": uid}},
    }


def test_a_pod_bound_report_token_names_its_pod():
    assert claimed_pod(token(pod_claims()), NOW) == ClaimedPod("team-a", "demo-a1-worker-0", "u-1")
    assert claimed_pod(token(pod_claims(aud=contract.REPORT_AUDIENCE)), NOW) is not None  # aud may be one string


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "a.b",
        "a..c",
        "é.é.é",
        "x" * (MAX_TOKEN_BYTES + 1),
        "a.!!!!.c",
        token([1, 2]),
        token(pod_claims(aud=["https://kubernetes.default.svc"])),
        token(pod_claims(exp=NOW - 1)),
        token(pod_claims(exp="never")),
        token(pod_claims(name="")),
        token({**pod_claims(), "kubernetes.io": {"namespace": "team-a"}}),
        "a." + base64.urlsafe_b64encode(b"[" * 6000).decode() + ".c",  # within the size cap, deeper than json recurses
    ],
)
def test_tokens_that_cannot_be_a_pods_report_token_are_refused_unread(bad):
    assert claimed_pod(bad, NOW) is None


def test_a_rate_limiter_allows_its_burst_then_its_rate():
    clock = [0.0]
    limiter = RateLimiter(rate=0.5, burst=2, clock=lambda: clock[0])
    assert [limiter.allow("pod") for _ in range(3)] == [True, True, False]
    assert limiter.allow("other pod")  # a bucket per key
    clock[0] = 1.0
    assert not limiter.allow("pod")  # half a token back
    clock[0] = 2.0
    assert limiter.allow("pod") and not limiter.allow("pod")


class Reviews:
    """Stands in for the API server's TokenReview: answers `authenticated` for tokens in `good`, counts calls."""

    def __init__(self, good):
        self.good, self.calls = good, 0

    async def request(self, method, path, body, priority):
        self.calls += 1
        authenticated = body["spec"]["token"] in self.good
        return {
            "status": {
                "authenticated": authenticated,
                "audiences": [contract.REPORT_AUDIENCE],
                "user": {
                    "username": "system:serviceaccount:team-a:trainer",
                    "extra": {POD_NAME_EXTRA: ["demo-a1-worker-0"], POD_UID_EXTRA: ["u-1"]},
                },
            }
        }


def reviewer(reviews, clock, **limits):
    return TokenReviewer(lambda: reviews, cache_seconds=60, clock=lambda: clock[0], wall_clock=lambda: NOW, **limits)


def test_an_accepted_token_is_reviewed_once_a_period_and_a_refused_one_not_again_at_once():
    good, forged = token(pod_claims()), token(pod_claims(), signature="forged")
    reviews, clock = Reviews({good}), [0.0]
    tokens = reviewer(reviews, clock)

    async def go():
        caller = await tokens.caller(good, "10.0.0.1")
        assert (caller.namespace, caller.service_account, caller.pod_uid) == ("team-a", "trainer", "u-1")
        assert await tokens.caller(good, "10.0.0.1") == caller
        assert reviews.calls == 1
        assert await tokens.caller(forged, "10.0.0.2") is None
        assert await tokens.caller(forged, "10.0.0.2") is None
        assert reviews.calls == 2
        clock[0] = 61.0
        assert await tokens.caller(good, "10.0.0.1") == caller
        assert reviews.calls == 3

    asyncio.run(go())


def test_junk_and_unknown_pods_cost_no_review():
    reviews, clock = Reviews(set()), [0.0]
    tokens = reviewer(reviews, clock)
    tokens.known_pod = lambda pod: pod.uid == "u-1"

    async def go():
        assert await tokens.caller("junk", "s") is None
        assert await tokens.caller(token(pod_claims(uid="u-unknown")), "s") is None
        assert await tokens.caller("x" * (MAX_TOKEN_BYTES + 1), "s") is None

    asyncio.run(go())
    assert reviews.calls == 0 and tokens.refused_unreviewed == 3


def test_new_tokens_over_a_pods_rate_are_429_and_a_due_accepted_one_keeps_its_answer():
    first = token(pod_claims())
    reviews, clock = Reviews({first}), [0.0]
    tokens = reviewer(reviews, clock, per_pod_rate=0.0, per_pod_burst=1)

    async def go():
        caller = await tokens.caller(first, "s")
        with pytest.raises(Refused) as refused:
            await tokens.caller(token({**pod_claims(), "jti": "second"}), "s")
        assert refused.value.code == 429
        clock[0] = 61.0  # the first token's review is due, and the pod has no room for one
        assert await tokens.caller(first, "s") == caller
        assert tokens.deferred == 1 and reviews.calls == 1
        clock[0] = 200.0  # past one more period: forgotten, and still no room
        with pytest.raises(Refused):
            await tokens.caller(first, "s")

    asyncio.run(go())
