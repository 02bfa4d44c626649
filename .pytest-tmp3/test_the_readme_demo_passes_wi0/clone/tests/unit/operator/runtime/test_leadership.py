"""Which operator replica acts: the rule (earliest start acts; kopf's peering records) and its follower."""

import asyncio
from datetime import datetime, timedelta, timezone

import pytest

from trainingrun_operator.runtime import leadership
from trainingrun_operator.runtime.kube import ApiError

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=timezone.utc)
ME, PRIORITY = "operator-b/1/aa", leadership.start_priority(2_000_000_000)


def record(priority, seen_seconds_ago=1, lifetime=60):
    return {
        "priority": priority,
        "lifetime": lifetime,
        "lastseen": (NOW - timedelta(seconds=seen_seconds_ago)).isoformat(),
    }


def test_an_earlier_start_is_a_higher_priority():
    assert leadership.start_priority(1_000_000_000) > leadership.start_priority(2_000_000_000)


@pytest.mark.parametrize(
    "others, acts",
    [
        ({}, True),  # alone
        ({"operator-a/1/bb": record(leadership.start_priority(1_000_000_000))}, False),  # started earlier, alive
        ({"operator-a/1/bb": record(leadership.start_priority(1_000_000_000), seen_seconds_ago=61)}, True),  # dead
        ({"operator-c/1/cc": record(leadership.start_priority(3_000_000_000))}, True),  # started later
        ({"operator-c/1/cc": record(PRIORITY)}, False),  # the same priority: kopf pauses both
        ({"operator-a/1/bb": None}, True),  # a record kopf removed (merge-patched to null)
        (
            {
                "operator-a/1/bb": {
                    **record(leadership.start_priority(1_000_000_000)),  # older kopf: naive UTC
                    "lastseen": (NOW - timedelta(seconds=1)).replace(tzinfo=None).isoformat(),
                }
            },
            False,
        ),
    ],
)
def test_a_replica_acts_when_no_live_replica_started_earlier(others, acts):
    assert leadership.acts({ME: record(PRIORITY), **others}, ME, PRIORITY, NOW) is acts


def test_a_replica_kopf_has_not_announced_yet_stands_by():
    assert leadership.acts({}, ME, PRIORITY, NOW) is False


def test_peering_objects_cluster_wide_or_per_namespace():
    assert leadership.peering_paths("tr", ()) == ["/apis/kopf.dev/v1/clusterkopfpeerings/tr"]
    assert leadership.peering_paths("tr", ("a", "b")) == [
        "/apis/kopf.dev/v1/namespaces/a/kopfpeerings/tr",
        "/apis/kopf.dev/v1/namespaces/b/kopfpeerings/tr",
    ]


def test_the_follower_sets_and_clears_acting_as_the_peering_object_changes():
    older = {"operator-a/1/bb": record(leadership.start_priority(1_000_000_000), seen_seconds_ago=0)}
    answers = [older, {}, ApiError(404, "NotFound", "gone")]
    changes = []

    async def get(path):
        answer = answers.pop(0) if answers else ApiError(404, "NotFound", "gone")
        if isinstance(answer, Exception):
            raise answer
        mine = {ME: {**record(PRIORITY), "lastseen": datetime.now(timezone.utc).isoformat()}}
        return {
            "status": {
                **mine,
                **{k: {**v, "lastseen": datetime.now(timezone.utc).isoformat()} for k, v in answer.items()},
            }
        }

    async def scenario():
        acting = asyncio.Event()
        task = asyncio.create_task(
            leadership.follow(get, ["/p"], ME, PRIORITY, acting, changes.append, check_seconds=0)
        )
        while len(changes) < 3:
            await asyncio.sleep(0)
        task.cancel()
        return acting.is_set()

    assert asyncio.run(scenario()) is False
    assert changes == [False, True, False]  # an older replica acts; it went; the peering object is gone
