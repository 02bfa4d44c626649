"""Which of several operator replicas acts (the chart's `replicaCount` > 1, kopf peering).

kopf pauses every replica but the one with the highest peering priority, and pauses all of them when the
highest priority is shared: replicas left at kopf's default priority (0) all stand by and nothing is
reconciled. So a replica's priority is its start time, negated: the replica started first acts, one started
later (a rolling update's new pod) never displaces it, and when the acting replica goes (kopf removes its
record on exit, or the record expires after its lifetime) the next oldest takes over.

kopf pauses only its own watch streams. The operator's loops (the resync, the reconcile workers, the report
endpoint) stand by as well: they follow the same peering objects, by the same rule, through `follow`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any, Awaitable, Callable, Mapping, Optional, Sequence

from trainingrun_api import contract

from .kube import ApiError

log = logging.getLogger("trainingrun.operator")

PEERING_API = "kopf.dev/v1"
#: How often a replica reads the peering objects: the longest a replica that just became the oldest waits
#: before its loops act (kopf itself resumes at once on the peering event).
CHECK_SECONDS = 2.0


def start_priority(started_ns: Optional[int] = None) -> int:
    """Earlier start, higher priority; microseconds, so two replicas practically never share one."""
    return -((time.time_ns() if started_ns is None else started_ns) // 1000)


def identity() -> str:
    """This replica's name among peers: the pod's name in a pod (kopf's own convention), unique anyway."""
    return f"{os.environ.get('POD_ID') or socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


def acts(peers: Mapping[str, Any], me: str, priority: int, now: datetime) -> bool:
    """Whether kopf lets this replica act, from a peering object's `status` (identity -> record): kopf has
    recorded it, and no other live replica has a priority as high."""
    if me not in peers:
        return False  # kopf has not announced this replica yet: it is still paused
    for other, record in peers.items():
        if other == me or not isinstance(record, Mapping):
            continue
        lastseen = contract.parse_time(str(record.get("lastseen") or ""))
        if lastseen and lastseen.tzinfo is None:
            lastseen = lastseen.replace(tzinfo=timezone.utc)  # older kopf versions wrote naive UTC times
        alive = lastseen is None or lastseen + timedelta(seconds=int(record.get("lifetime", 60))) > now
        if alive and int(record.get("priority", 0)) >= priority:
            return False
    return True


def peering_paths(name: str, namespaces: Sequence[str]) -> list[str]:
    """kopf's peering objects for this operator: one cluster-wide, or one per watched namespace."""
    if not namespaces:
        return [f"/apis/{PEERING_API}/clusterkopfpeerings/{name}"]
    return [f"/apis/{PEERING_API}/namespaces/{namespace}/kopfpeerings/{name}" for namespace in namespaces]


async def follow(
    get: Callable[[str], Awaitable[dict[str, Any]]],
    paths: Sequence[str],
    me: str,
    priority: int,
    acting: asyncio.Event,
    on_change: Callable[[bool], None] = lambda acting: None,
    check_seconds: float = CHECK_SECONDS,
) -> None:
    """Set `acting` while this replica acts in every peering object, clear it otherwise; for ever.

    While the API server cannot be read the last answer stands: kopf cannot read it either."""
    said: Optional[bool] = None
    while True:
        try:
            now = datetime.now(timezone.utc)
            objects = [await get(path) for path in paths]
            verdict = all(acts((o.get("status") or {}), me, priority, now) for o in objects)
        except ApiError as error:
            verdict = False if error.status == 404 else bool(said)  # no peering object: kopf stays paused too
            if error.status != 404:
                log.warning(
                    "cannot read the peering object (%s); %s meanwhile", error, "acting" if verdict else "standing by"
                )
        except (OSError, asyncio.TimeoutError):
            verdict = bool(said)
        if verdict != said:
            (acting.set if verdict else acting.clear)()
            on_change(verdict)
            if verdict:
                log.info("acting: no replica started earlier is alive (peering %s)", ", ".join(paths))
            else:
                log.info("standing by: another replica acts (peering %s)", ", ".join(paths))
            said = verdict
        await asyncio.sleep(check_seconds)
