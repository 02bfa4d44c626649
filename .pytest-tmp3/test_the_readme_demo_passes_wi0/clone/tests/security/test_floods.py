"""Floods a pod, or anyone who reaches the report endpoint, can send: junk bearer tokens, forged tokens shaped like
a pod's, and a run's own pod reporting a thousand times a second. None may cost the API server more than a small,
bounded share, nor push out what legitimate pods need.

The reviewer's API client here records the TokenReviews it is asked for and answers them as the API server would
for these tokens; the real server's answers are tested in tests/real_api/test_reports_real.py, and the flood against
a real server is `benchmarks/report_endpoint.py --flood`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

import pytest

from trainingrun_api import contract
from trainingrun_operator import report_callers, reports
from trainingrun_operator.runtime.kube import REVIEW

pytestmark = pytest.mark.asyncio
GOOD = "good"


def jwt(audience=contract.REPORT_AUDIENCE, expires_in=3600, pod=True, marker="x", pod_uid="u") -> str:
    def part(value):
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    claims = {
        "aud": [audience],
        "exp": time.time() + expires_in,
        "iss": "https://kubernetes.default.svc",
        "sub": "system:serviceaccount:ns:trainers",
        "marker": marker,
    }
    if pod:
        claims["kubernetes.io"] = {
            "namespace": "ns",
            "pod": {"name": "p", "uid": pod_uid},
            "serviceaccount": {"name": "trainers", "uid": "s"},
        }
    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2lnbmF0dXJl"


LEGITIMATE = jwt(marker=GOOD)


class ApiServer:
    """Answers TokenReviews: only LEGITIMATE authenticates. Counts them, their priority and how many run at once."""

    def __init__(self, delay: float = 0.0):
        self.delay, self.reviews, self.in_flight, self.most_in_flight, self.priorities = delay, 0, 0, 0, set()

    async def request(self, method, path, body, priority=0):
        self.reviews += 1
        self.priorities.add(priority)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        if body["spec"]["token"] != LEGITIMATE:
            return {"status": {"authenticated": False}}
        return {
            "status": {
                "authenticated": True,
                "audiences": [contract.REPORT_AUDIENCE],
                "user": {
                    "username": "system:serviceaccount:ns:trainers",
                    "extra": {report_callers.POD_NAME_EXTRA: ["p"], report_callers.POD_UID_EXTRA: ["u"]},
                },
            }
        }


@pytest.mark.parametrize(
    "token",
    [
        "junk",
        "a.b",
        "x" * 10_000,
        "not.base64!.sig",
        jwt(audience="https://kubernetes.default.svc"),
        jwt(expires_in=-60),
        jwt(pod=False),
        "\u00e9.\u00e9.\u00e9",
    ],
)
async def test_a_token_that_cannot_be_a_pods_report_token_costs_no_token_review(token):
    server = ApiServer()
    reviewer = report_callers.TokenReviewer(lambda: server, 60)
    assert await reviewer.caller(token, "10.0.0.9") is None
    assert server.reviews == 0 and reviewer.refused_unreviewed == 1


async def test_two_thousand_junk_tokens_cost_no_token_review_and_keep_the_pods_token():
    """On main: 2,000 TokenReviews at the operator's top priority, and the cache wiped whole at 20,000."""
    server = ApiServer()
    reviewer = report_callers.TokenReviewer(lambda: server, 60)
    assert (await reviewer.caller(LEGITIMATE, "10.0.0.1")).pod_name == "p"
    for number in range(report_callers.TOKEN_CACHE_SIZE + 2000):
        await reviewer.caller(f"junk-{number}", "10.0.0.9")
    assert server.reviews == 1
    assert (await reviewer.caller(LEGITIMATE, "10.0.0.1")).pod_name == "p"  # from memory
    assert server.reviews == 1


async def test_forged_tokens_naming_no_pod_of_a_run_cost_no_token_review():
    """The claimed pod must be a pod of an active run in the operator's index: forged tokens name none."""
    server = ApiServer()
    known = {"u"}
    reviewer = report_callers.TokenReviewer(lambda: server, 60, known_pod=lambda pod: pod.uid in known)
    for number in range(2000):
        assert await reviewer.caller(jwt(marker=str(number), pod_uid=f"forged-{number}"), "10.0.0.9") is None
    assert server.reviews == 0 and reviewer.refused_unreviewed == 2000
    assert (await reviewer.caller(LEGITIMATE, "10.0.0.9")).pod_name == "p"  # the same address, a real pod


async def test_tokens_naming_a_real_pod_are_reviewed_at_that_pods_rate_only():
    server = ApiServer()
    reviewer = report_callers.TokenReviewer(lambda: server, 60, per_pod_rate=0.2, per_pod_burst=3)
    throttled = 0
    for number in range(500):
        try:
            await reviewer.caller(jwt(marker=str(number), pod_uid="victim"), "10.0.0.9")
        except report_callers.Refused as refusal:
            assert refusal.code == 429
            throttled += 1
    assert server.reviews == 3 and throttled == 497
    assert (await reviewer.caller(LEGITIMATE, "10.0.0.9")).pod_name == "p"  # another pod is not held back
    assert server.priorities == {REVIEW}


async def test_one_address_may_bring_many_pods_first_tokens_but_not_without_bound():
    """Pods behind one address (host network, a proxy) each get their first review; a flood from it is capped."""
    server = ApiServer()
    now = [1000.0]  # the reviewer's clock, moved by the test: a busy machine's slow loop refills nothing
    reviewer = report_callers.TokenReviewer(
        lambda: server, 60, lambda: now[0], per_source_rate=20, per_source_burst=200
    )

    async def flood(first: int, count: int) -> list:
        outcomes = []
        for number in range(first, first + count):
            try:
                outcomes.append(await reviewer.caller(jwt(marker=str(number), pod_uid=f"pod-{number}"), "10.0.0.9"))
            except report_callers.Refused as refusal:
                outcomes.append(refusal.code)
        return outcomes

    outcomes = await flood(0, 1000)
    assert server.reviews == 200 and outcomes.count(429) == 800  # the burst, then nothing
    now[0] += 1.0
    outcomes = await flood(1000, 100)
    assert server.reviews == 220 and outcomes.count(429) == 80  # a second's rate


async def test_reviews_have_a_small_lane_and_a_full_lane_answers_at_once():
    server = ApiServer(delay=0.05)
    reviewer = report_callers.TokenReviewer(lambda: server, 60, reviews_in_flight=2, reviews_waiting=4)

    async def one(number):
        try:
            return await reviewer.caller(jwt(marker=str(number), pod_uid=f"pod-{number}"), f"10.0.1.{number}")
        except report_callers.Refused as refusal:
            return refusal.code

    outcomes = await asyncio.gather(*(one(number) for number in range(50)))
    assert server.most_in_flight == 2
    assert outcomes.count(429) == 50 - 6 and server.reviews == 6


async def test_an_accepted_token_expires_from_the_cache_and_is_reviewed_again():
    now = [0.0]
    server = ApiServer()
    reviewer = report_callers.TokenReviewer(lambda: server, 60, clock=lambda: now[0])
    await reviewer.caller(LEGITIMATE, "10.0.0.1")
    now[0] = 59
    await reviewer.caller(LEGITIMATE, "10.0.0.1")
    assert server.reviews == 1
    now[0] = 61
    await reviewer.caller(LEGITIMATE, "10.0.0.1")
    assert server.reviews == 2


async def test_a_thousand_reports_in_a_second_are_one_or_two_status_writes_and_the_newest_wins():
    """On main: 1,000 reports that each changed loss by 1e-9 were 1,000 status PATCHes at top priority."""
    written = []

    async def write(key, fields):
        written.append((key, fields))

    writes = reports.CoalescedWrites(write, seconds=0.2)
    for number in range(1000):
        await writes.submit(
            ("ns", "demo"), {"progress": {"step": 5, "loss": 1.0 + number * 1e-9}, "lastReportTime": str(number)}
        )
    await writes.submit(("ns", "other"), {"progress": {"step": 1}})
    assert len(written) == 2  # the first of each run, at once
    await asyncio.wait_for(asyncio.gather(*writes.flushing.values()), 5)
    assert len(written) == 3
    key, fields = written[-1]
    assert key == ("ns", "demo") and fields["lastReportTime"] == "999"
    assert fields["progress"]["loss"] == pytest.approx(1.0 + 999e-9)


async def test_a_report_after_a_quiet_period_is_written_at_once():
    now = [0.0]
    written = []

    async def write(key, fields):
        written.append(fields)

    writes = reports.CoalescedWrites(write, seconds=3, clock=lambda: now[0])
    await writes.submit(("ns", "demo"), {"progress": {"step": 1}})
    now[0] = 3.5
    await writes.submit(("ns", "demo"), {"progress": {"step": 2}})
    assert [fields["progress"]["step"] for fields in written] == [1, 2] and not writes.flushing


async def test_an_accepted_token_due_for_review_stands_while_the_lane_is_full_for_one_more_period_only():
    """2,000 pods' tokens fall due together every cache period: a full lane answers a due token from memory (and
    reviews it when a later report finds room); a new token is still refused, and a due one past a second period
    or no longer a pod of a run is not answered from memory."""
    now = [0.0]
    server = ApiServer()
    known = {"u"}
    reviewer = report_callers.TokenReviewer(
        lambda: server, 60, clock=lambda: now[0], reviews_waiting=1, known_pod=lambda pod: pod.uid in known
    )
    assert (await reviewer.caller(LEGITIMATE, "10.0.0.1")).pod_name == "p"
    reviewer.reviews_waiting = 0  # from here the lane is full
    now[0] = 100  # due since 60
    assert (await reviewer.caller(LEGITIMATE, "10.0.0.1")).pod_name == "p"
    assert server.reviews == 1 and reviewer.deferred == 1
    with pytest.raises(report_callers.Refused) as refused:
        await reviewer.caller(jwt(marker="new"), "10.0.0.1")
    assert refused.value.code == 429
    reviewer.reviews_waiting = 1  # room again: the due token is reviewed, and good for a period from now
    assert (await reviewer.caller(LEGITIMATE, "10.0.0.1")).pod_name == "p" and server.reviews == 2
    reviewer.reviews_waiting = 0
    now[0] = 219  # due since 160, within one more period
    assert (await reviewer.caller(LEGITIMATE, "10.0.0.1")).pod_name == "p" and server.reviews == 2
    now[0] = 221  # two periods since its review: not from memory
    with pytest.raises(report_callers.Refused):
        await reviewer.caller(LEGITIMATE, "10.0.0.1")
    reviewer.reviews_waiting = 1
    assert (await reviewer.caller(LEGITIMATE, "10.0.0.1")).pod_name == "p" and server.reviews == 3
    reviewer.reviews_waiting, known = 0, set()
    reviewer.known_pod = lambda pod: pod.uid in known
    now[0] = 300  # due, but its pod is gone from the runs
    assert await reviewer.caller(LEGITIMATE, "10.0.0.1") is None and server.reviews == 3
